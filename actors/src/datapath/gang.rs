//! A trainer's channel to the other members of its gangs (sequence splitting): a persistent inbox
//! on the job's transport (C7), registered once per trainer in the node's [`CollectiveGroup`] —
//! the directory of trainer inboxes the collective path uses — so that any backend carries a
//! gang's exchange, within a process or across processes and hosts. In collective mode the gang
//! shares the collective path's inbox ([`GangChannel::sharing`]); its write ids carry the top
//! bit ([`GANG_NAMESPACE`]), which the collective's never do.
//!
//! Invariants (tested below):
//! - a message is received by its attempt's epoch and its write id alone, in any arrival order;
//! - **every wait has a deadline (I6)** and fails with an error naming the peer and the message;
//! - **a discarded attempt ends its waits at once (I2)**: the supervisor's discard raises the
//!   group's epoch floor ([`CollectiveGroup::abort_before`]) on every node, and a receive of an
//!   older epoch fails with [`Error::CollectiveAborted`], whether it was waiting or starts later;
//! - **a peer that is gone is the supervisor's to handle**: a send to a trainer that is
//!   unreachable, or whose inbox is gone, waits
//!   (until its deadline) for the attempt to be discarded — the supervisor learns of the loss from
//!   the control plane and replays — and then ends as aborted, so that a member does not fail the
//!   step for its peer's death; only if the deadline passes first is it this member's error.

use std::sync::Arc;

use bytes::Bytes;
use odc_transport::{Deadline, InboxRegion, Transport, TransportError, WriteTag};

use super::collective::TRAINER_ENDPOINT_BASE;
use super::CollectiveGroup;
use crate::error::{Error, Result};

/// The bit every gang message's write id carries (the collective's message ids leave it clear).
pub const GANG_NAMESPACE: u128 = 1 << 127;

/// See the [module docs](self).
pub struct GangChannel {
    rank: u32,
    transport: Arc<dyn Transport>,
    group: Arc<CollectiveGroup>,
    inbox: Arc<dyn InboxRegion>,
}

impl std::fmt::Debug for GangChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GangChannel")
            .field("rank", &self.rank)
            .field("inbox", &self.inbox.handle().id)
            .finish()
    }
}

impl GangChannel {
    /// Registers trainer `rank`'s inbox on `transport` and in `group`.
    pub fn new(
        rank: u32,
        transport: Arc<dyn Transport>,
        group: Arc<CollectiveGroup>,
    ) -> Result<Self> {
        let inbox = transport.register_inbox(TRAINER_ENDPOINT_BASE + rank, group.floor())?;
        group.register(rank, inbox.handle())?;
        Ok(Self::sharing(rank, transport, group, Arc::from(inbox)))
    }

    /// Trainer `rank`'s channel over an inbox already registered in `group` (collective mode:
    /// the collective path's, [`Collective::inbox`](super::Collective::inbox)).
    pub fn sharing(
        rank: u32,
        transport: Arc<dyn Transport>,
        group: Arc<CollectiveGroup>,
        inbox: Arc<dyn InboxRegion>,
    ) -> Self {
        GangChannel {
            rank,
            transport,
            group,
            inbox,
        }
    }

    /// This trainer's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// A micro-batch of attempt `epoch` starts: the inbox forgets older epochs.
    pub fn begin(&self, epoch: u64) {
        if epoch > self.inbox.epoch() {
            self.inbox.advance(epoch);
        }
    }

    /// Sends `data` to trainer `to`'s inbox as message `write_id` of attempt `epoch`.
    pub async fn send(
        &self,
        to: u32,
        epoch: u64,
        write_id: u128,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<()> {
        let inbox = self.group.inbox(to)?;
        let sent = self
            .transport
            .send(&inbox, Self::tag(epoch, write_id), data, deadline)
            .await;
        self.sent(to, epoch, sent, deadline).await
    }

    fn tag(epoch: u64, write_id: u128) -> WriteTag {
        WriteTag {
            epoch,
            write_id: write_id | GANG_NAMESPACE,
            token: 0,
        }
    }

    /// A send's outcome as the module docs say: a peer that is gone waits for the discard.
    async fn sent(
        &self,
        to: u32,
        epoch: u64,
        sent: std::result::Result<(), TransportError>,
        deadline: Deadline,
    ) -> Result<()> {
        match sent {
            Ok(()) => Ok(()),
            Err(
                source
                @ (TransportError::Unreachable { .. } | TransportError::UnknownRegion { .. }),
            ) => {
                // The peer is gone: wait for the supervisor's discard (see the module docs).
                let aborted = self.group.aborted(epoch);
                let until = tokio::time::Instant::from_std(deadline);
                match tokio::time::timeout_at(until, aborted).await {
                    Ok(()) => Err(Error::CollectiveAborted),
                    Err(_) => Err(Error::Gang { peer: to, source }),
                }
            }
            Err(source) => Err(Error::Gang { peer: to, source }),
        }
    }

    /// Waits for message `write_id` of attempt `epoch` from trainer `from`: its bytes, or an
    /// error at the deadline (naming `from`), or [`Error::CollectiveAborted`] as soon as the
    /// attempt is discarded.
    pub async fn recv(
        &self,
        from: u32,
        epoch: u64,
        write_id: u128,
        deadline: Deadline,
    ) -> Result<Bytes> {
        let recv = self.inbox.recv(Self::tag(epoch, write_id), deadline);
        self.received(from, epoch, recv).await
    }

    /// A receive's outcome, ended at once by the attempt's discard (see the module docs).
    async fn received<T>(
        &self,
        from: u32,
        epoch: u64,
        recv: impl std::future::Future<Output = std::result::Result<T, TransportError>>,
    ) -> Result<T> {
        if epoch < self.group.floor() {
            return Err(Error::CollectiveAborted);
        }
        let aborted = self.group.aborted(epoch);
        tokio::pin!(recv, aborted);
        tokio::select! {
            biased;
            () = &mut aborted => Err(Error::CollectiveAborted),
            got = &mut recv => got.map_err(|source| match source {
                TransportError::Aborted { .. } => Error::CollectiveAborted,
                source => Error::Gang { peer: from, source },
            }),
        }
    }
}

/// Messages whose values stay in device memory (feature `cuda-code`, the job's transport
/// odc-transport's `cuda` backend): a gang's K/V between the GPUs of a host with no host copy.
/// The same fences, deadlines and discards as [`GangChannel::send`] and [`GangChannel::recv`].
#[cfg(feature = "cuda-code")]
impl GangChannel {
    /// The job's transport as the `cuda` backend, if it is.
    fn cuda(&self) -> Option<&odc_transport::cuda::CudaTransport> {
        super::cuda_backend(&self.transport)
    }

    /// Whether this channel carries device messages.
    pub fn device_messages(&self) -> bool {
        self.cuda().is_some()
    }

    fn no_device(&self) -> Error {
        Error::Internal(format!(
            "trainer {}: a device message on the {} transport",
            self.rank,
            self.transport.backend()
        ))
    }

    /// [`GangChannel::send`] of a message whose values are `values` (device memory of the
    /// transport's device, complete, in order) and whose `header` says what they are.
    pub async fn send_device(
        &self,
        to: u32,
        epoch: u64,
        write_id: u128,
        header: Bytes,
        values: &[odc_transport::DeviceDest],
        deadline: Deadline,
    ) -> Result<()> {
        let cuda = self.cuda().ok_or_else(|| self.no_device())?;
        let inbox = self.group.inbox(to)?;
        let tag = Self::tag(epoch, write_id);
        let sent = cuda
            .send_device(&inbox, tag, header, values, deadline)
            .await;
        self.sent(to, epoch, sent, deadline).await
    }

    /// [`GangChannel::recv`] of a message sent either way: its header, and its values in the
    /// transport's device memory if it was sent by [`GangChannel::send_device`]
    /// ([`GangChannel::copy_out`] moves them where they go).
    pub async fn recv_device(
        &self,
        from: u32,
        epoch: u64,
        write_id: u128,
        deadline: Deadline,
    ) -> Result<(Bytes, Option<odc_transport::cuda::DeviceValues>)> {
        let cuda = self.cuda().ok_or_else(|| self.no_device())?;
        let recv = cuda.recv_device(self.inbox.as_ref(), Self::tag(epoch, write_id), deadline);
        self.received(from, epoch, recv).await
    }

    /// Copy received `values` whole into `dests` (memory of the transport's device, in order,
    /// as many bytes in all) and wait.
    pub fn copy_out(
        &self,
        values: &odc_transport::cuda::DeviceValues,
        dests: &[odc_transport::DeviceDest],
        deadline: Deadline,
    ) -> Result<()> {
        let cuda = self.cuda().ok_or_else(|| self.no_device())?;
        Ok(cuda.copy_out(values, dests, deadline)?)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use odc_transport::deadline_in;
    use odc_transport::local::LocalTransport;

    use super::*;

    fn pair() -> (GangChannel, GangChannel) {
        let transport: Arc<dyn Transport> = Arc::new(LocalTransport::new());
        let group = Arc::new(CollectiveGroup::new(2));
        (
            GangChannel::new(0, transport.clone(), group.clone()).unwrap(),
            GangChannel::new(1, transport, group).unwrap(),
        )
    }

    #[tokio::test]
    async fn messages_arrive_by_epoch_and_id_in_any_order() {
        let (a, b) = pair();
        let soon = deadline_in(Duration::from_secs(5));
        a.send(1, 0, 7, Bytes::from_static(b"seven"), soon)
            .await
            .unwrap();
        a.send(1, 0, 3, Bytes::from_static(b"three"), soon)
            .await
            .unwrap();
        assert_eq!(&b.recv(0, 0, 3, soon).await.unwrap()[..], b"three");
        assert_eq!(&b.recv(0, 0, 7, soon).await.unwrap()[..], b"seven");
    }

    #[tokio::test]
    async fn a_silent_peer_is_a_deadline_error_naming_it() {
        let (_a, b) = pair();
        let e = b
            .recv(0, 0, 1, deadline_in(Duration::from_millis(100)))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Gang { peer: 0, .. }), "{e}");
        assert!(e.to_string().contains("trainer 0"), "{e}");
    }

    #[tokio::test]
    async fn a_send_to_a_peer_that_is_gone_waits_for_the_discard() {
        let (a, b) = pair();
        drop(b);
        let a = Arc::new(a);
        // The supervisor discards the attempt: the send ends as aborted, not as an error.
        let sending = {
            let a = a.clone();
            tokio::spawn(async move {
                a.send(
                    1,
                    0,
                    1,
                    Bytes::from_static(b"x"),
                    deadline_in(Duration::from_secs(600)),
                )
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.group.abort_before(1);
        let e = tokio::time::timeout(Duration::from_secs(30), sending)
            .await
            .expect("ended at the discard")
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, Error::CollectiveAborted), "{e}");
        // Without a discard, the deadline makes it this member's error, naming the peer.
        let e = a
            .send(
                1,
                1,
                2,
                Bytes::from_static(b"x"),
                deadline_in(Duration::from_millis(50)),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Gang { peer: 1, .. }), "{e}");
    }

    #[tokio::test]
    async fn a_discarded_attempt_ends_its_waits_at_once() {
        let (a, b) = pair();
        let b = Arc::new(b);
        let waiting = {
            let b = b.clone();
            tokio::spawn(
                async move { b.recv(0, 0, 1, deadline_in(Duration::from_secs(600))).await },
            )
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        a.group.abort_before(1);
        let e = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("aborted at once")
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, Error::CollectiveAborted), "{e}");
        // And one that starts later.
        let e = b
            .recv(0, 0, 2, deadline_in(Duration::from_secs(600)))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::CollectiveAborted), "{e}");
    }
}
