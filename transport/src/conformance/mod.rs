//! The conformance suite: one generic set of checks of the crate's contract (C1–C8 and the handle
//! rules) that every backend runs. Compiled with the feature `conformance`.
//!
//! **Owner and reader are separate transport instances joined only by serialized handles.** A
//! backend provides a factory returning a [`Pair`]; every check registers its regions through
//! `pair.owner` (and drives the owner's guards), and does every read, accumulate and send through
//! `pair.reader`, with a handle that went through `serde_json` ([`ship`]). For a process-crossing
//! backend the reader may stand for a transport in another process.
//!
//! One file per clause: `c1_read.rs`, `c2_accumulate.rs`, `c3_fencing.rs`, `c4_bounds.rs`,
//! `c5_chunking.rs`, `c6_deadlines.rs` (batches and deadlines), `c7_inbox.rs`, `c8_admission.rs`
//! and `handles.rs`. Each
//! check is a public `async fn(Pair)` whose name ends in the clause it checks; it panics (it is a
//! test) with a message that names the backend. [`run_all`] runs them all in sequence against one
//! pair; [`conformance_tests!`](crate::conformance_tests) expands to one test per check (and one for
//! `run_all`), each on a two-worker multi-threaded tokio runtime under a timeout:
//!
//! ```
//! // transport/tests/<backend>_conformance.rs
//! use std::sync::Arc;
//! use odc_transport::{conformance::Pair, local::LocalTransport};
//!
//! async fn make_pair() -> Pair {
//!     Pair {
//!         owner: Arc::new(LocalTransport::with_inbox_capacity(64)),
//!         reader: Arc::new(LocalTransport::new()),
//!     }
//! }
//!
//! odc_transport::conformance_tests!(make_pair);
//! # fn main() {}
//! ```
//!
//! What a factory must know:
//! - Every region is registered with owner [`OWNER`]. Waits use deadlines of at most
//!   [`PATIENCE`], below the per-check timeout, so a missing wake-up is reported as a wrong result,
//!   not as a hang.
//! - The inbox checks send as many messages as the inbox's [`capacity`](crate::InboxRegion::capacity):
//!   configure a small one (at least [`MIN_INBOX_CAPACITY`]; the in-tree factories use 64).
//! - `device_destination_is_unsupported_c4` expects a host backend to refuse a device destination
//!   with [`crate::TransportError::Unsupported`]. A backend that supports device destinations
//!   (feature `cuda`) passes by refusing the null device address it is given with any other typed
//!   error; then the check is skipped (it says so on stderr). Succeeding is a failure either way.
//! - `refused_write_changes_nothing_c8` installs a write guard through the owner's accumulator
//!   guard; an owner that cannot take one ([`remote_owner`]: a closure does not cross to the child
//!   process) answers [`crate::TransportError::Unsupported`] and the check is skipped (on stderr).
//!   The in-process suites of the same backends run it.
//! - Each check runs under a 60 s timeout (`run_all` under 600 s).
//!
//! The checks are written so that a wrong backend fails them: destinations are pre-filled with a
//! sentinel no read can produce, contents are distinct per element (an offset error shows),
//! versions and epochs differ between regions (a mix-up shows), and every refusal is followed by a
//! check that the refused request left no trace (its write id is still free, its message is not
//! held, the destination still holds the sentinel). Values are exactly representable, so results
//! are compared bit for bit whatever the order of concurrent operations.

mod c1_read;
mod c2_accumulate;
mod c3_fencing;
mod c4_bounds;
mod c5_chunking;
mod c6_deadlines;
mod c7_inbox;
mod c8_admission;
mod handles;
pub mod remote_owner;

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;

pub use self::c1_read::*;
pub use self::c2_accumulate::*;
pub use self::c3_fencing::*;
pub use self::c4_bounds::*;
pub use self::c5_chunking::*;
pub use self::c6_deadlines::*;
pub use self::c7_inbox::*;
pub use self::c8_admission::*;
pub use self::handles::*;
use crate::{
    codec, deadline_in, AccumulatorRegion, Deadline, Dest, Dtype, EndpointId, InboxRegion,
    PublishedRegion, RegionHandle, RegionKind, RemoteConfig, Transport, TransportError, WriteTag,
};

/// The endpoint that owns every region the suite registers (not 0, so a backend that forgets the
/// owner shows).
pub const OWNER: EndpointId = 3;

/// The longest any check waits for one operation (its deadline); below the per-check timeout.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// The smallest inbox capacity the inbox checks work with.
pub const MIN_INBOX_CAPACITY: usize = 8;

/// The two sides of every check: regions are registered through `owner`, every peer operation
/// goes through `reader`. They must share no state but what a serialized handle carries (for
/// `local`: two `LocalTransport::new()`).
#[derive(Clone)]
pub struct Pair {
    pub owner: Arc<dyn Transport>,
    pub reader: Arc<dyn Transport>,
}

impl Pair {
    /// `owner` and `reader` as a pair.
    pub fn new(owner: impl Transport, reader: impl Transport) -> Self {
        Self {
            owner: Arc::new(owner),
            reader: Arc::new(reader),
        }
    }

    /// Two transports that `open` makes of one `config`, the owner first (two instances of a
    /// backend, e.g. `Pair::open_two(config, TcpTransport::bind)`).
    pub async fn open_two<C, T, F>(config: C, open: impl Fn(C) -> F) -> Self
    where
        C: Clone,
        T: Transport,
        F: Future<Output = Result<T, TransportError>>,
    {
        let failed = |e: TransportError| panic!("opening a transport of the pair failed: {e}");
        let owner = open(config.clone()).await.unwrap_or_else(failed);
        let reader = open(config).await.unwrap_or_else(failed);
        Self::new(owner, reader)
    }
}

/// The inbox capacity the suite's own pairs give their owners: room for the checks' bursts, few
/// enough that `InboxFull` is reached quickly.
pub const INBOX_CAPACITY: usize = 64;

/// The peer knobs of a process-crossing backend in the suite's own pairs: [`INBOX_CAPACITY`], the
/// rest the defaults.
pub fn remote_config() -> RemoteConfig {
    RemoteConfig {
        inbox_capacity: INBOX_CAPACITY,
        ..RemoteConfig::default()
    }
}

/// A job id (`{prefix}{pid}-{n}`) no other pair of this process has: backends that name their
/// files after the job (`shm`, `cuda`) then never meet another pair's files.
pub fn unique_job(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl std::fmt::Debug for Pair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pair")
            .field("owner", &self.owner.backend())
            .field("reader", &self.reader.backend())
            .finish()
    }
}

/// Run every check against `pair`, in sequence (regions of earlier checks are dropped before the
/// next starts). Panics on the first failure.
pub async fn run_all(pair: Pair) {
    crate::__odc_conformance_checks!(@run pair);
}

/// The list of checks, handed to [`conformance_tests!`](crate::conformance_tests) (`@tests`) and
/// to [`run_all`] (`@run`). The one place a new check is listed.
#[doc(hidden)]
#[macro_export]
macro_rules! __odc_conformance_checks {
    (@$mode:ident $arg:tt) => {
        $crate::conformance_tests!(@$mode $arg;
            read_returns_published_contents_c1,
            f32_reads_are_bit_exact_c1,
            bf16_reads_round_to_nearest_even_c1,
            read_sees_whole_publication_c1,
            accumulate_adds_and_acks_c2,
            concurrent_accumulates_sum_exactly_c2,
            stale_epoch_refused_c3,
            duplicate_write_refused_c3,
            take_moves_epoch_atomically_c3,
            take_applied_names_the_applied_writes_c3,
            progress_counts_the_applied_writes_c3,
            bad_requests_are_typed_errors_c4,
            bad_destination_is_refused_c4,
            device_destination_is_unsupported_c4,
            empty_regions_and_ranges_are_valid_c4,
            chunked_read_equals_whole_read_c5,
            chunked_accumulate_equals_whole_accumulate_c5,
            read_batch_results_in_order_c6,
            accumulate_batch_results_in_order_c6,
            expired_deadline_changes_nothing_c6,
            recv_without_message_times_out_c6,
            send_then_recv_by_tag_c7,
            inbox_stale_epoch_refused_c7,
            inbox_duplicate_refused_even_after_recv_c7,
            advance_aborts_waiters_and_drops_messages_c7,
            inbox_capacity_bounds_held_messages_c7,
            concurrent_senders_inbox_c7,
            refused_write_changes_nothing_c8,
            inbox_ignores_tokens_c8,
            handles_round_trip_through_serde_handles,
            foreign_handle_is_refused_handles,
            dropped_region_is_unknown_handles,
            region_ids_are_never_reused_handles,
        );
    };
}

/// Expands to one `#[tokio::test]` per conformance check (and one running them all), each on a
/// two-worker multi-threaded runtime under a timeout, against the [`Pair`](crate::conformance::Pair)
/// returned by `$make`, a path to an `async fn() -> Pair` (called once per test). The calling crate
/// needs `tokio` with the `macros`, `rt-multi-thread` and `time` features.
///
/// `conformance_tests!(make_pair, unless = skip)` does the same, except that each test first calls
/// `skip`, a `fn() -> Option<String>`, and passes after printing the reason on stderr when it says
/// one (a backend that needs hardware the machine lacks: `cuda` without a driver).
#[macro_export]
macro_rules! conformance_tests {
    (@tests $make:path; $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                let pair: $crate::conformance::Pair = $make().await;
                let outcome = ::tokio::time::timeout(
                    ::std::time::Duration::from_secs(60),
                    $crate::conformance::$check(pair),
                )
                .await;
                assert!(
                    outcome.is_ok(),
                    concat!("conformance check `", stringify!($check), "` timed out after 60 s")
                );
            }
        )*
    };
    (@tests_unless [$make:path, $skip:path]; $($check:ident),* $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $check() {
                if let Some(reason) = $skip() {
                    eprintln!(concat!("skipped `", stringify!($check), "`: {}"), reason);
                    return;
                }
                let pair: $crate::conformance::Pair = $make().await;
                let outcome = ::tokio::time::timeout(
                    ::std::time::Duration::from_secs(60),
                    $crate::conformance::$check(pair),
                )
                .await;
                assert!(
                    outcome.is_ok(),
                    concat!("conformance check `", stringify!($check), "` timed out after 60 s")
                );
            }
        )*
    };
    (@run $pair:ident; $($check:ident),* $(,)?) => {
        $( $crate::conformance::$check($pair.clone()).await; )*
    };
    ($make:path, unless = $skip:path) => {
        $crate::__odc_conformance_checks!(@tests_unless [$make, $skip]);

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn run_all() {
            if let Some(reason) = $skip() {
                eprintln!("skipped `run_all`: {}", reason);
                return;
            }
            let pair: $crate::conformance::Pair = $make().await;
            let outcome = ::tokio::time::timeout(
                ::std::time::Duration::from_secs(600),
                $crate::conformance::run_all(pair),
            )
            .await;
            assert!(outcome.is_ok(), "conformance `run_all` timed out after 600 s");
        }
    };
    ($make:path) => {
        $crate::__odc_conformance_checks!(@tests $make);

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn run_all() {
            let pair: $crate::conformance::Pair = $make().await;
            let outcome = ::tokio::time::timeout(
                ::std::time::Duration::from_secs(600),
                $crate::conformance::run_all(pair),
            )
            .await;
            assert!(outcome.is_ok(), "conformance `run_all` timed out after 600 s");
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// What every byte destination holds before a read. Checks compare whole destinations with the
/// expected bytes (never all `0xa5`), so a backend that writes nothing, or too little, fails.
const SENTINEL_BYTE: u8 = 0xa5;

/// A NaN with a payload that no check publishes and no bf16 widens to (its low half is not zero).
fn sentinel_f32() -> f32 {
    f32::from_bits(0x7fa5_a5a5)
}

/// `handle` (of backend `b`) describes a region of `kind` registered by [`OWNER`], `len` elements
/// long (0 for an inbox), at `version` (a published region's version; an accumulator's or an
/// inbox's epoch).
fn assert_describes(b: &str, handle: &RegionHandle, kind: RegionKind, len: usize, version: u64) {
    assert_eq!(handle.owner, OWNER, "{b}: {kind:?} handle owner");
    assert_eq!(handle.kind, kind, "{b}: {kind:?} handle kind");
    assert_eq!(
        handle.len, len as u64,
        "{b}: {kind:?} handle length in elements"
    );
    assert_eq!(
        handle.version, version,
        "{b}: a {kind:?} handle carries its version or epoch"
    );
}

/// Send `handle` the way a control message would: through `serde_json`. Panics if the handle
/// does not survive the trip unchanged.
pub fn ship(handle: &RegionHandle) -> RegionHandle {
    let wire = match serde_json::to_vec(handle) {
        Ok(wire) => wire,
        Err(e) => panic!("handle {handle:?} does not serialize: {e}"),
    };
    let shipped: RegionHandle = match serde_json::from_slice(&wire) {
        Ok(shipped) => shipped,
        Err(e) => panic!("handle {handle:?} does not deserialize: {e}"),
    };
    assert_eq!(
        &shipped, handle,
        "handle changed on its way through serde_json"
    );
    shipped
}

/// A deadline no correct backend misses in a check.
fn soon() -> Deadline {
    deadline_in(PATIENCE)
}

/// A deadline that has already passed.
fn expired() -> Deadline {
    let now = crate::now();
    now.checked_sub(Duration::from_secs(1)).unwrap_or(now)
}

/// `len` distinct values `i * step + 1`, exactly representable in `dtype`.
fn ramp(dtype: Dtype, len: usize, step: f32) -> Vec<f32> {
    (0..len)
        .map(|i| codec::round_trip(dtype, i as f32 * step + 1.0))
        .collect()
}

/// A tag with no token (an unguarded region admits every token).
fn tag(epoch: u64, write_id: u128) -> WriteTag {
    WriteTag {
        epoch,
        write_id,
        token: 0,
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// A region of each kind, registered through the owner of a [`Pair`].
type OneOfEach = (
    Box<dyn PublishedRegion>,
    Box<dyn AccumulatorRegion>,
    Box<dyn InboxRegion>,
);

/// A published region holding `initial` (`dtype`) at `version`, an accumulator of `len` elements
/// and an inbox, both at epoch 0; and their handles, shipped.
fn one_of_each(
    pair: &Pair,
    dtype: Dtype,
    initial: Bytes,
    version: u64,
    len: usize,
) -> (OneOfEach, [RegionHandle; 3]) {
    let published = register_published(pair, dtype, initial, version);
    let accumulator = register_accumulator(pair, len, 0);
    let inbox = register_inbox(pair, 0);
    let handles = [
        ship(&published.handle()),
        ship(&accumulator.handle()),
        ship(&inbox.handle()),
    ];
    ((published, accumulator, inbox), handles)
}

fn register_published(
    pair: &Pair,
    dtype: Dtype,
    initial: Bytes,
    version: u64,
) -> Box<dyn PublishedRegion> {
    let bytes = initial.len();
    match pair
        .owner
        .register_published(OWNER, dtype, initial, version)
    {
        Ok(region) => region,
        Err(e) => panic!(
            "{}: registering {bytes} bytes of {dtype:?} failed: {e}",
            pair.owner.backend()
        ),
    }
}

fn register_accumulator(pair: &Pair, len: usize, epoch: u64) -> Box<dyn AccumulatorRegion> {
    match pair.owner.register_accumulator(OWNER, len, epoch) {
        Ok(region) => region,
        Err(e) => panic!(
            "{}: registering an accumulator of {len} elements failed: {e}",
            pair.owner.backend()
        ),
    }
}

fn register_inbox(pair: &Pair, epoch: u64) -> Box<dyn InboxRegion> {
    match pair.owner.register_inbox(OWNER, epoch) {
        Ok(region) => region,
        Err(e) => panic!(
            "{}: registering an inbox at epoch {epoch} failed: {e}",
            pair.owner.backend()
        ),
    }
}

fn must_publish(backend: &str, region: &dyn PublishedRegion, version: u64, data: Bytes) {
    if let Err(e) = region.publish(version, data) {
        panic!("{backend}: publish of version {version} failed: {e}");
    }
}

/// Read `range` through the reader into a sentinel-filled byte destination of the right size.
async fn read_bytes(
    pair: &Pair,
    handle: &RegionHandle,
    range: Range<usize>,
) -> (Result<u64, TransportError>, Vec<u8>) {
    let mut out = vec![SENTINEL_BYTE; range.len() * handle.dtype.size()];
    let result = pair
        .reader
        .read(handle, range, Dest::Bytes(&mut out), soon())
        .await;
    (result, out)
}

/// Read `range` through the reader into a sentinel-filled `f32` destination of the right size.
async fn read_f32(
    pair: &Pair,
    handle: &RegionHandle,
    range: Range<usize>,
) -> (Result<u64, TransportError>, Vec<f32>) {
    let mut out = vec![sentinel_f32(); range.len()];
    let result = pair
        .reader
        .read(handle, range, Dest::F32(&mut out), soon())
        .await;
    (result, out)
}

async fn must_read_bytes(
    pair: &Pair,
    handle: &RegionHandle,
    range: Range<usize>,
) -> (u64, Vec<u8>) {
    match read_bytes(pair, handle, range.clone()).await {
        (Ok(version), out) => (version, out),
        (Err(e), _) => panic!(
            "{}: byte read of {range:?} from region {} failed: {e}",
            pair.reader.backend(),
            handle.id
        ),
    }
}

async fn must_read_f32(pair: &Pair, handle: &RegionHandle, range: Range<usize>) -> (u64, Vec<f32>) {
    match read_f32(pair, handle, range.clone()).await {
        (Ok(version), out) => (version, out),
        (Err(e), _) => panic!(
            "{}: f32 read of {range:?} from region {} failed: {e}",
            pair.reader.backend(),
            handle.id
        ),
    }
}

async fn accumulate(
    pair: &Pair,
    handle: &RegionHandle,
    offset: usize,
    values: &[f32],
    tag: WriteTag,
) -> Result<(), TransportError> {
    pair.reader
        .accumulate(handle, offset, codec::encode_f32(values), tag, soon())
        .await
}

async fn must_accumulate(
    pair: &Pair,
    handle: &RegionHandle,
    offset: usize,
    values: &[f32],
    tag: WriteTag,
) {
    if let Err(e) = accumulate(pair, handle, offset, values, tag).await {
        panic!(
            "{}: accumulate of {} elements at {offset} into region {} failed: {e}",
            pair.reader.backend(),
            values.len(),
            handle.id
        );
    }
}

async fn send(
    pair: &Pair,
    inbox: &RegionHandle,
    tag: WriteTag,
    data: &[u8],
) -> Result<(), TransportError> {
    pair.reader
        .send(inbox, tag, Bytes::copy_from_slice(data), soon())
        .await
}

async fn must_send(pair: &Pair, inbox: &RegionHandle, tag: WriteTag, data: &[u8]) {
    if let Err(e) = send(pair, inbox, tag, data).await {
        panic!(
            "{}: send of {} bytes tagged {tag:?} into inbox {} failed: {e}",
            pair.reader.backend(),
            data.len(),
            inbox.id
        );
    }
}

async fn must_recv(backend: &str, inbox: &dyn InboxRegion, tag: WriteTag) -> Bytes {
    match inbox.recv(tag, soon()).await {
        Ok(data) => data,
        Err(e) => panic!("{backend}: recv of {tag:?} failed: {e}"),
    }
}

fn assert_refused<T>(
    backend: &str,
    what: &str,
    got: Result<T, TransportError>,
    expected: TransportError,
) {
    match got {
        Ok(_) => panic!("{backend}: {what}: expected {expected:?}, but it succeeded"),
        Err(e) => assert_eq!(e, expected, "{backend}: {what}"),
    }
}

/// Await a spawned task, re-raising its panic (with its message) if it panicked.
async fn join<T>(task: JoinHandle<T>) -> T {
    match task.await {
        Ok(value) => value,
        Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("conformance task did not complete: {e}"),
        },
    }
}
