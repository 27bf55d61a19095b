//! One priced-transport wrapper: every transfer is given a modelled end by a [`Pricer`], and the
//! operation waits until then at the pricer's [`Pace`] before it returns (a read) or before the
//! owner applies it (an accumulate, an inbox message). The bytes still move through the wrapped
//! backend, so contents and the contract's clauses C1–C8 are the inner backend's; only time is
//! modelled. The link throttle ([`crate::throttle`]: a link per owner, FIFO) and the benchmark's
//! modelled cluster (NVLink and NIC ports per device) are two pricers of this one wrapper.
//!
//! Deadlines (C6), the same for every pricer: an accumulate or a send whose deadline has passed is
//! refused before it is priced (a refused write occupies nothing); a read is priced after the
//! inner read returned (a refused read moves no bytes). A transfer whose modelled end lies past
//! its deadline waits until the deadline and fails with [`TransportError::DeadlineExceeded`]: an
//! accumulate or a send is then not applied; a read has already written its destination, whose
//! contents are then unspecified. What a transfer reserved stays reserved either way.

use std::ops::Range;
use std::time::Instant;

use bytes::Bytes;

use crate::wrap::Wrap;
use crate::{
    check_deadline, now, Deadline, Dest, EndpointId, Op, RegionHandle, RegionId, Transport,
    TransportError, WriteTag,
};

/// How a modelled wait (a transfer here, a simulated device's compute elsewhere) spends time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pace {
    /// Wall time: `std::thread::sleep` on a blocking thread (tens of microseconds of error, where
    /// tokio's timer would round up to the next millisecond).
    #[default]
    Wall,
    /// tokio's timer. On a runtime started paused (`start_paused(true)`, current-thread) the wait
    /// costs virtual time only; tokio's timer resolution is 1 ms of that time, so a simulation
    /// stretches its model to make a millisecond small (see `odc::sim::clock`).
    Virtual,
}

impl Pace {
    /// Wait until `until`, an instant of tokio's clock ([`crate::now`]).
    pub async fn wait_until(self, until: Instant) {
        match self {
            Pace::Wall => {
                let wait = until.saturating_duration_since(now());
                // A blocking thread sleeps precisely; if the pool is gone, fall back to the timer.
                if !wait.is_zero()
                    && tokio::task::spawn_blocking(move || std::thread::sleep(wait))
                        .await
                        .is_err()
                {
                    tokio::time::sleep_until(until.into()).await;
                }
            }
            Pace::Virtual => tokio::time::sleep_until(until.into()).await,
        }
    }
}

/// When each transfer ends: an instant of tokio's clock ([`crate::now`]), or `None` when it costs
/// nothing (unpriced). Each call reserves what the transfer occupies from now on.
pub trait Pricer: Send + Sync + 'static {
    /// How the wrapper waits.
    fn pace(&self) -> Pace;
    /// A read of `range` of `handle` that returned `version`.
    fn read(&self, handle: &RegionHandle, range: Range<usize>, version: u64) -> Option<Instant>;
    /// An accumulate of `bytes` bytes at element `offset` of `handle`.
    fn accumulate(&self, handle: &RegionHandle, offset: usize, bytes: usize) -> Option<Instant>;
    /// A message of `bytes` bytes into the inbox `inbox`.
    fn send(&self, inbox: &RegionHandle, bytes: usize) -> Option<Instant>;
}

/// `inner` with every transfer priced by `pricer` (see the [module docs](self)); a [`Wrap`], so
/// `crate::wrap::Wrapped(Priced::new(..))` is the transport.
pub struct Priced<P> {
    inner: std::sync::Arc<dyn Transport>,
    pricer: P,
}

impl<P: std::fmt::Debug> std::fmt::Debug for Priced<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Priced")
            .field("inner", &self.inner.backend())
            .field("pricer", &self.pricer)
            .finish()
    }
}

impl<P: Pricer> Priced<P> {
    pub fn new(inner: std::sync::Arc<dyn Transport>, pricer: P) -> Self {
        Self { inner, pricer }
    }

    /// The pricer.
    pub fn pricer(&self) -> &P {
        &self.pricer
    }

    /// The pricer, to change it before the wrapper is shared.
    pub fn pricer_mut(&mut self) -> &mut P {
        &mut self.pricer
    }

    /// Wait until `done`, or fail at `deadline` if that comes first.
    async fn wait(
        &self,
        done: Option<Instant>,
        deadline: Deadline,
        owner: EndpointId,
        region: RegionId,
        op: Op,
    ) -> Result<(), TransportError> {
        let Some(done) = done else {
            return Ok(());
        };
        self.pricer.pace().wait_until(done.min(deadline)).await;
        if done > deadline {
            Err(TransportError::DeadlineExceeded { owner, region, op })
        } else {
            Ok(())
        }
    }
}

#[async_trait::async_trait]
impl<P: Pricer> Wrap for Priced<P> {
    fn inner(&self) -> &dyn Transport {
        &*self.inner
    }

    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        // The inner read checks first: a refused request moves no bytes and is not priced.
        let version = self
            .inner
            .read(handle, range.clone(), into, deadline)
            .await?;
        let done = self.pricer.read(handle, range, version);
        self.wait(done, deadline, handle.owner, handle.id, Op::Read)
            .await?;
        Ok(version)
    }

    async fn accumulate(
        &self,
        handle: &RegionHandle,
        offset: usize,
        data: Bytes,
        tag: WriteTag,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        // The bytes cross the links before the owner applies them.
        check_deadline(deadline, handle.owner, handle.id, Op::Accumulate)?;
        let done = self.pricer.accumulate(handle, offset, data.len());
        self.wait(done, deadline, handle.owner, handle.id, Op::Accumulate)
            .await?;
        self.inner
            .accumulate(handle, offset, data, tag, deadline)
            .await
    }

    async fn send(
        &self,
        inbox: &RegionHandle,
        tag: WriteTag,
        data: Bytes,
        deadline: Deadline,
    ) -> Result<(), TransportError> {
        // The message crosses the links before it sits in the inbox.
        check_deadline(deadline, inbox.owner, inbox.id, Op::Send)?;
        let done = self.pricer.send(inbox, data.len());
        self.wait(done, deadline, inbox.owner, inbox.id, Op::Send)
            .await?;
        self.inner.send(inbox, tag, data, deadline).await
    }
}
