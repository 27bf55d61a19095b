//! Pull and push latency of the `local` transport.
//!
//! - `local_pull_4MiB_bf16`: read a 4 MiB bf16 region (2 Mi elements) and decode it into an fp32
//!   buffer, either as one whole read or as four 1 MiB chunks issued concurrently (`join_all`, each
//!   chunk decoded into its slice of the output as it arrives) — the C5 decomposition. Compare the
//!   two within one run; the ratio is the cost of chunking when the owner is in-process.
//! - `local_push_1MiB_f32`: accumulate 1 MiB of fp32 gradient (256 Ki elements), whole or as four
//!   256 KiB chunks issued concurrently, each its own write.
//!
//! Futures run on a tokio current-thread runtime via `block_on` inside `iter`, since criterion's
//! async support is not enabled. Both groups report throughput in bytes.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use futures::future::join_all;
use odc_transport::local::LocalTransport;
use odc_transport::{chunk_ranges, codec, Dest, Dtype, Transport, WriteTag};

const MIB: usize = 1 << 20;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("tokio current-thread runtime")
}

fn pull(c: &mut Criterion) {
    let rt = runtime();
    let transport = LocalTransport::new();
    let len = 4 * MIB / Dtype::Bf16.size();
    let chunk_elems = MIB / Dtype::Bf16.size();
    let values: Vec<f32> = (0..len).map(|i| (i % 1024) as f32 * 0.01).collect();
    let region = transport
        .register_published(0, Dtype::Bf16, codec::encode(Dtype::Bf16, &values), 1)
        .expect("register published region");
    let handle = region.handle();
    let mut out = vec![0.0f32; len];

    let mut group = c.benchmark_group("local_pull_4MiB_bf16");
    group
        .throughput(Throughput::Bytes((4 * MIB) as u64))
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    group.bench_function("whole", |b| {
        b.iter(|| {
            rt.block_on(async {
                transport
                    .read(&handle, 0..len, Dest::F32(&mut out), deadline())
                    .await
                    .expect("read");
            });
            black_box(&out);
        })
    });
    group.bench_function("chunks_1MiB_concurrent", |b| {
        b.iter(|| {
            rt.block_on(async {
                let pulls = chunk_ranges(0..len, chunk_elems)
                    .zip(out.chunks_mut(chunk_elems))
                    .map(|(range, dst)| {
                        let transport = &transport;
                        let handle = &handle;
                        async move {
                            transport
                                .read(handle, range, Dest::F32(dst), deadline())
                                .await
                                .expect("read");
                        }
                    });
                join_all(pulls).await;
            });
            black_box(&out);
        })
    });
    group.finish();
}

fn push(c: &mut Criterion) {
    let rt = runtime();
    let transport = LocalTransport::new();
    let len = MIB / Dtype::F32.size();
    let chunk_elems = len / 4;
    let acc = transport
        .register_accumulator(0, len, 0)
        .expect("register accumulator");
    let handle = acc.handle();
    let grad: Vec<f32> = (0..len).map(|i| (i % 7) as f32 * 1e-3).collect();
    let whole = codec::encode_f32(&grad);
    let chunks: Vec<_> = chunk_ranges(0..len, chunk_elems)
        .map(|range| {
            let bytes = codec::encode_f32(&grad[range.clone()]);
            (range.start, bytes)
        })
        .collect();
    // Every write of the epoch needs its own id.
    let next_write = AtomicU64::new(0);
    let write_tag = || WriteTag {
        epoch: 0,
        write_id: u128::from(next_write.fetch_add(1, Ordering::Relaxed)),
        token: 0,
    };

    let mut group = c.benchmark_group("local_push_1MiB_f32");
    group
        .throughput(Throughput::Bytes(MIB as u64))
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    group.bench_function("whole", |b| {
        b.iter(|| {
            rt.block_on(transport.accumulate(&handle, 0, whole.clone(), write_tag(), deadline()))
                .expect("accumulate");
        })
    });
    group.bench_function("chunks_256KiB_concurrent", |b| {
        b.iter(|| {
            let pushes = chunks.iter().map(|(offset, bytes)| {
                transport.accumulate(&handle, *offset, bytes.clone(), write_tag(), deadline())
            });
            for result in rt.block_on(join_all(pushes)) {
                result.expect("accumulate");
            }
        })
    });
    group.finish();
}

/// Far enough in the future for any iteration.
fn deadline() -> odc_transport::Deadline {
    odc_transport::deadline_in(Duration::from_secs(60))
}

criterion_group!(benches, pull, push);
criterion_main!(benches);
