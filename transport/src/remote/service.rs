//! The owner's side of a connection: handshake, then answer requests in order from the fabric.

use std::sync::{Arc, OnceLock};

use tokio::io::{AsyncRead, AsyncWrite};

use super::{RemoteConfig, Renamed};
use crate::local::LocalTransport;
use crate::wire::frame::{write_frame, FrameError, FrameReader};
use crate::wire::gate::Permit;
use crate::wire::handshake::{self, ClusterSecret};
use crate::wire::sealed::SessionKeys;
use crate::wire::{IpcSource, Request, Response, Target};
use crate::{
    deadline_in, AccumulatorRegion, Deadline, Descriptor, EndpointId, InboxRegion, RegionId,
    Transport, TransportError, WriteTag,
};

/// The regions one transport instance serves to peers: its fabric, and the instance number that
/// handles to them carry (a request for another instance names an unknown region).
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) instance: u64,
    pub(crate) fabric: LocalTransport,
    pub(crate) config: RemoteConfig,
    pub(crate) secret: ClusterSecret,
    /// How this owner opens a writer's device memory ([`Request::AccumulateDevice`]): set by a
    /// backend with a device (`cuda`); without it such a request is refused.
    pub(crate) device_sources: OnceLock<Arc<dyn DeviceSources>>,
}

/// An owner's way to a writer's device memory on its host.
pub(crate) trait DeviceSources: Send + Sync {
    /// `source` mapped into this process: its device address, valid while the returned value
    /// lives. Memory it cannot reach (no live allocation, a range past its end) is an error.
    fn open(
        &self,
        source: &IpcSource,
    ) -> Result<(u64, Arc<dyn std::any::Any + Send + Sync>), TransportError>;

    /// Copy `source` into this owner's device memory and hold it as the values of inbox
    /// `region`'s message `tag` ([`Request::SendDevice`]), until the receiver takes it. A payload
    /// already held under the same epoch and write id is [`TransportError::DuplicateWrite`], and
    /// nothing is copied.
    fn hold(
        &self,
        region: RegionId,
        tag: &WriteTag,
        source: &IpcSource,
    ) -> Result<(), TransportError>;

    /// Drop what [`DeviceSources::hold`] holds for `tag` (its message was refused).
    fn forget(&self, region: RegionId, tag: &WriteTag);
}

impl std::fmt::Debug for dyn DeviceSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceSources")
    }
}

impl Served {
    /// A fresh fabric under a random instance number (never reused, so a handle to an earlier
    /// instance at the same address names an unknown region).
    /// A handshake timeout over [`RemoteConfig::MAX_HANDSHAKE_TIMEOUT`] is cut to it.
    pub(crate) fn new(mut config: RemoteConfig, secret: ClusterSecret) -> Arc<Self> {
        config.handshake_timeout = config
            .handshake_timeout
            .min(RemoteConfig::MAX_HANDSHAKE_TIMEOUT);
        Arc::new(Served {
            instance: rand::RngCore::next_u64(&mut rand::rng()),
            fabric: LocalTransport::with_inbox_capacity(config.inbox_capacity),
            config,
            secret,
            device_sources: OnceLock::new(),
        })
    }

    /// When a connection accepted now must have completed its handshake.
    pub(crate) fn handshake_deadline(&self) -> Deadline {
        deadline_in(self.config.handshake_timeout)
    }

    /// Whether `target` is one of these regions (instance numbers are random 64-bit values, so
    /// the instance alone decides).
    pub(crate) fn owns(&self, target: &Target) -> bool {
        target.instance == self.instance
    }

    /// Register an accumulator in the fabric; its handles carry `descriptor`.
    pub(crate) fn register_accumulator(
        &self,
        descriptor: Descriptor,
        owner: EndpointId,
        len: usize,
        epoch: u64,
    ) -> Result<Box<dyn AccumulatorRegion>, TransportError> {
        let inner = self.fabric.register_accumulator(owner, len, epoch)?;
        Ok(Box::new(Renamed { descriptor, inner }))
    }

    /// Register an accumulator in the fabric whose values live in `values`; the caller's wrapper
    /// gives its handles the caller's descriptor (the `cuda` backend's `DeviceAccumulator`).
    #[cfg_attr(not(feature = "cuda-code"), allow(dead_code))]
    pub(crate) fn register_accumulator_in(
        &self,
        owner: EndpointId,
        len: usize,
        epoch: u64,
        values: Box<dyn crate::local::accumulator::Sums>,
    ) -> Result<crate::local::AccumulatorGuard, TransportError> {
        self.fabric
            .register_accumulator_in(owner, len, epoch, values)
    }

    /// Register an inbox in the fabric; its handles carry `descriptor`.
    pub(crate) fn register_inbox(
        &self,
        descriptor: Descriptor,
        owner: EndpointId,
        epoch: u64,
    ) -> Result<Box<dyn InboxRegion>, TransportError> {
        let inner = self.fabric.register_inbox(owner, epoch)?;
        Ok(Box::new(Renamed { descriptor, inner }))
    }

    fn check_instance(&self, target: &Target) -> Result<(), TransportError> {
        if self.owns(target) {
            Ok(())
        } else {
            Err(TransportError::UnknownRegion {
                owner: target.owner,
                region: target.region,
            })
        }
    }

    /// A writer's device memory added into accumulator `target` at `offset`: opened through
    /// this owner's device, then the fabric's fenced device add (C2, C3, C8 as any accumulate).
    fn accumulate_device(
        &self,
        target: &Target,
        offset: u64,
        tag: crate::WriteTag,
        source: &IpcSource,
    ) -> Result<(), TransportError> {
        let sources =
            self.sources_for(|| format!("an accumulate into region {}", target.region))?;
        if source.bytes % 4 != 0 {
            return Err(TransportError::BadDestination {
                region: target.region,
                expected: source.bytes / 4 * 4,
                got: source.bytes,
            });
        }
        let (ptr, _mapped) = sources.open(source)?;
        let index = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        self.fabric.serve_accumulate_device(
            target.owner,
            target.region,
            index(offset),
            ptr,
            index(source.bytes / 4),
            tag,
        )
    }

    /// How this owner opens a writer's device memory, or why `what` (from another process's
    /// device memory) is refused: it has no device.
    fn sources_for(
        &self,
        what: impl FnOnce() -> String,
    ) -> Result<&Arc<dyn DeviceSources>, TransportError> {
        self.device_sources
            .get()
            .ok_or_else(|| TransportError::Unsupported {
                what: format!(
                    "{} from another process's device memory: this owner has no device",
                    what()
                ),
            })
    }

    /// An inbox send whose values lie in a writer's device memory: the values copied into this
    /// owner's device memory and held for the receiver first, then the message (`data`, what the
    /// values are) delivered under the inbox's fences (C7); a refused message drops its values.
    fn send_device(
        &self,
        target: &Target,
        tag: WriteTag,
        source: &IpcSource,
        data: bytes::Bytes,
    ) -> Result<(), TransportError> {
        let sources = self.sources_for(|| format!("a send into inbox {}", target.region))?;
        sources.hold(target.region, &tag, source)?;
        let delivered = self
            .fabric
            .serve_send(target.owner, target.region, tag, data);
        if delivered.is_err() {
            sources.forget(target.region, &tag);
        }
        delivered
    }

    /// Answer one request.
    pub(crate) fn answer(&self, request: Request) -> Response {
        let req = request.req();
        let outcome = match request {
            Request::Read {
                target,
                start,
                end,
                part,
                dest,
                ..
            } => self
                .check_instance(&target)
                .and_then(|()| {
                    self.fabric
                        .serve_read(target.owner, target.region, (start, end), part, dest)
                })
                .and_then(|(version, dtype, data)| {
                    if data.len() > self.config.frame_cap.saturating_sub(64) {
                        Err(super::too_large(
                            "a read part",
                            data.len(),
                            self.config.frame_cap,
                        ))
                    } else {
                        Ok(Response::ReadOk {
                            req,
                            version,
                            dtype,
                            data,
                        })
                    }
                }),
            Request::Accumulate {
                target,
                offset,
                tag,
                data,
                ..
            } => self.check_instance(&target).and_then(|()| {
                self.fabric
                    .serve_accumulate(target.owner, target.region, offset, &data, tag)
                    .map(|()| Response::Done { req })
            }),
            Request::Send {
                target, tag, data, ..
            } => self.check_instance(&target).and_then(|()| {
                self.fabric
                    .serve_send(target.owner, target.region, tag, data)
                    .map(|()| Response::Done { req })
            }),
            Request::AccumulateDevice {
                target,
                offset,
                tag,
                source,
                ..
            } => self
                .check_instance(&target)
                .and_then(|()| self.accumulate_device(&target, offset, tag, &source))
                .map(|()| Response::Done { req }),
            Request::SendDevice {
                target,
                tag,
                source,
                data,
                ..
            } => self
                .check_instance(&target)
                .and_then(|()| self.send_device(&target, tag, &source, data))
                .map(|()| Response::Done { req }),
        };
        outcome.unwrap_or_else(|error| Response::Failed { req, error })
    }
}

/// What an accepted connection is served with.
pub(crate) struct Accepted {
    /// The regions it reaches.
    pub(crate) served: Arc<Served>,
    /// Its name in the log.
    pub(crate) peer: String,
    /// Its place among the listener's unauthenticated connections (`wire::gate`).
    pub(crate) permit: Permit,
    /// When its handshake must have ended (from its acceptance).
    pub(crate) deadline: Deadline,
}

impl Accepted {
    /// The handshake on `reader` and `writer`, by the connection's deadline; its permit is given
    /// back as soon as it ends. Authenticated: the connection's frames (at the handshake's cap),
    /// the regions it reaches and its name; refused: `None`, the reason logged (the caller closes
    /// the connection).
    pub(crate) async fn authenticate<R, W>(
        self,
        reader: R,
        writer: &mut W,
    ) -> Option<(R, SessionKeys, Arc<Served>, String)>
    where
        R: AsyncRead + Unpin,
        W: AsyncWrite + Unpin,
    {
        let mut frames = FrameReader::new(reader, handshake::HANDSHAKE_FRAME_CAP);
        let result =
            handshake::accept(&mut frames, writer, &self.served.secret, self.deadline).await;
        drop(self.permit);
        match result {
            Ok(keys) => Some((frames.into_inner(), keys, self.served, self.peer)),
            Err(e) => {
                tracing::warn!(peer = %self.peer, "odc transport: refused a connection: {e}");
                None
            }
        }
    }
}

/// Serve one accepted connection until the peer closes it or breaks the protocol. The handshake
/// must end by the connection's deadline; its permit is given back as soon as it does.
pub(crate) async fn serve_connection<R, W>(reader: R, mut writer: W, accepted: Accepted)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let Some((reader, keys, served, peer)) = accepted.authenticate(reader, &mut writer).await
    else {
        return;
    };
    let cap = served.config.frame_cap;
    if served.config.sealed_frames {
        let (reader, writer) = keys.seal(reader, writer);
        serve_frames(FrameReader::new(reader, cap), writer, &served, &peer).await;
    } else {
        serve_frames(FrameReader::new(reader, cap), writer, &served, &peer).await;
    }
}

/// Answer an authenticated connection's requests, in order, until it closes or breaks the
/// protocol.
async fn serve_frames<R, W>(mut reader: FrameReader<R>, mut writer: W, served: &Served, peer: &str)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        let body = match reader.next().await {
            Ok(body) => body,
            Err(FrameError::Closed) => return,
            Err(e) => {
                tracing::warn!(%peer, "odc transport: dropped a connection: {e}");
                return;
            }
        };
        let request = match Request::decode(body) {
            Ok(request) => request,
            Err(e) => {
                tracing::warn!(%peer, "odc transport: dropped a connection: bad request: {e}");
                return;
            }
        };
        let response = served.answer(request);
        let (head, payload) = response.encode();
        if let Err(e) = write_frame(&mut writer, &head, &payload).await {
            tracing::debug!(%peer, "odc transport: connection closed while answering: {e}");
            return;
        }
    }
}
