//! The `cuda` backend's unit tests: without a driver each says why it skipped; on a GPU (the
//! GPU bundle's `odc_transport_lib`, `benches/gpu/run.sh`) they run.

use super::*;
use crate::{Transport, WriteTag};

/// Why the device tests cannot run here, printed; `None` where a driver is present.
fn skip_without_driver(test: &str) -> bool {
    match check_driver() {
        Ok(()) => false,
        Err(e) => {
            eprintln!("skipped `{test}`: {e}");
            true
        }
    }
}

fn device() -> Arc<Device> {
    Device::open(0).unwrap_or_else(|e| panic!("device 0: {e}"))
}

/// A buffer of `device` holding `bytes`.
fn holding(device: &Arc<Device>, bytes: &[u8]) -> DeviceBuffer {
    let buffer = device.alloc(bytes.len()).expect("alloc");
    device.upload(&buffer, 0, bytes).expect("upload");
    buffer
}

#[test]
fn no_driver_is_a_clear_unsupported_error_everywhere() {
    if check_driver().is_ok() {
        eprintln!("not applicable: this machine has a CUDA driver");
        return;
    }
    let says_no_driver = |what: &str, result: Result<(), TransportError>| match result {
        Err(TransportError::Unsupported { what: said }) => {
            assert!(said.starts_with("no CUDA driver: "), "{what}: {said}")
        }
        other => panic!("{what}: expected Unsupported(no CUDA driver), got {other:?}"),
    };
    says_no_driver("check_driver", check_driver());
    says_no_driver("device_count", device_count().map(|_| ()));
    says_no_driver("Device::open", Device::open(0).map(|_| ()));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let secret = ClusterSecret::new("cuda-unit-secret").expect("secret");
    let transport = runtime.block_on(CudaTransport::new(CudaConfig::new(0, "cudaunit", secret)));
    says_no_driver("CudaTransport::new", transport.map(|_| ()));
}

/// The kernels' source compiles with NVRTC (no device needed; skipped where NVRTC does not
/// load, with the reason).
#[test]
fn kernel_source_compiles_with_nvrtc() {
    match odc_kernels::nvrtc::ptx(&odc_kernels::ACCUMULATE, (9, 0)) {
        Ok(text) => {
            for name in ["odc_add_f32", "odc_add_bf16", "odc_encode_bf16"] {
                assert!(text.contains(name), "the PTX has no {name}");
            }
        }
        Err(odc_kernels::nvrtc::KernelError(what)) if what.starts_with("no NVRTC") => {
            eprintln!("skipped: {what}")
        }
        Err(e) => panic!("accumulate.cu does not compile: {e}"),
    }
}

/// C2 on the device: the f32 and bf16 accumulate kernels give exactly the host's fp32 sums
/// (values below bf16 resolution, negative values, an odd length that is no multiple of the
/// block).
#[test]
fn kernels_add_exactly_c2() {
    if skip_without_driver("kernels_add_exactly_c2") {
        return;
    }
    let device = device();
    let n = 3 * 256 * 1024 + 7;
    let acc: Vec<f32> = (0..n)
        .map(|i| 1.0 + (i % 977) as f32 * 2f32.powi(-20))
        .collect();
    let grad: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * -0.375 + 0.125).collect();
    let acc_buf = holding(&device, &codec::encode_f32(&acc));
    let src_buf = holding(&device, &codec::encode_f32(&grad));
    device.add_f32(&acc_buf, &src_buf).expect("add_f32");
    let got = codec::decode_f32(&device.download(&acc_buf).expect("download")).expect("decode");
    assert_eq!(got.len(), n);
    for (i, ((g, a), s)) in got.iter().zip(&acc).zip(&grad).enumerate() {
        assert_eq!(
            g.to_bits(),
            (a + s).to_bits(),
            "f32 element {i}: {g} != {a} + {s}"
        );
    }

    let bf16 = codec::encode(Dtype::Bf16, &grad);
    let widened = codec::decode(Dtype::Bf16, &bf16).expect("decode");
    let half_buf = holding(&device, &bf16);
    device.add_bf16(&acc_buf, &half_buf).expect("add_bf16");
    let again = codec::decode_f32(&device.download(&acc_buf).expect("download")).expect("decode");
    assert_eq!(again.len(), n);
    for (i, ((g, a), w)) in again.iter().zip(&got).zip(&widened).enumerate() {
        assert!(!g.is_nan(), "bf16 element {i} is NaN");
        assert_eq!(
            g.to_bits(),
            (a + w).to_bits(),
            "bf16 element {i}: {g} != {a} + {w}"
        );
    }
}

/// Copies keep every byte: a device copy, uploads and downloads through the pinned staging
/// (larger than it, so in pieces), the raw staging copies; a buffer too small for a copy is
/// refused.
#[test]
fn copies_and_staging_keep_every_byte() {
    if skip_without_driver("copies_and_staging_keep_every_byte") {
        return;
    }
    let device = device();
    let n = STAGING_BYTES + 4096 + 12;
    let data: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
    let a = holding(&device, &data);
    let b = device.alloc(n).expect("alloc");
    device.copy(&b, &a).expect("copy");
    assert_eq!(device.download(&b).expect("download"), data);
    device.stage_out(&b).expect("staging out");
    device.stage_in(&b).expect("staging in");
    assert_eq!(
        device.download(&b).expect("download")[n - STAGING_BYTES..],
        data[n - STAGING_BYTES..],
        "the last piece staged out is what the staging held when it came back in"
    );
    // fp32 values decoded piece by piece (a piece boundary inside the values) equal the
    // bytes' little-endian decoding, and a read past the buffer is refused. (From `a`: the
    // staging in above filled every piece of `b` with the staging's last piece.)
    let len = (n - 12) / 4;
    let floats = device.download_f32(&a, len).expect("download_f32");
    assert_eq!(floats, codec::decode_f32(&data[..len * 4]).expect("decode"));
    assert!(device.download_f32(&a, n / 4 + 1).is_err(), "past the end");
    let small = device.alloc(n - 4).expect("alloc");
    assert!(matches!(
        device.copy(&small, &a),
        Err(TransportError::Unsupported { .. })
    ));
    assert!(
        device.upload(&small, 8, &data).is_err(),
        "an upload past the end"
    );
}

/// A transport on device 0 in a runtime of its own (job names unique per test).
fn transport(runtime: &tokio::runtime::Runtime, test: &str) -> CudaTransport {
    let secret = ClusterSecret::new("cuda-unit-secret").expect("secret");
    let job = format!("cudaunit{}-{test}", std::process::id());
    runtime
        .block_on(CudaTransport::new(CudaConfig::new(0, job, secret)))
        .unwrap_or_else(|e| panic!("transport: {e}"))
}

/// A runtime and a transport on device 0 (its job named after `job`) for `test`, or `None`
/// (and why, printed) without a driver.
fn runtime_and_transport(
    test: &str,
    job: &str,
) -> Option<(tokio::runtime::Runtime, CudaTransport)> {
    if skip_without_driver(test) {
        return None;
    }
    let runtime = runtime();
    let transport = transport(&runtime, job);
    Some((runtime, transport))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn deadline() -> Deadline {
    crate::deadline_in(std::time::Duration::from_secs(20))
}

/// The published bf16 copy written by the kernel from fp32 values in device memory is bit for
/// bit the host codec's encoding: ties to even, NaN payloads (quiet bit set), infinities,
/// subnormals, values that round up to infinity, and a million scattered bit patterns.
#[test]
fn encode_kernel_is_the_host_codec_bit_for_bit() {
    let Some((runtime, t)) =
        runtime_and_transport("encode_kernel_is_the_host_codec_bit_for_bit", "encode")
    else {
        return;
    };
    let mut bits: Vec<u32> = vec![
        0x3f80_0000,
        0x3f80_8000,
        0x3f81_8000,
        0x3f80_8001,
        0xbf80_8000,
        0x7f7f_ffff,
        0xff7f_ffff,
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xffa0_1234,
        0x0000_0001,
        0x8000_8000,
        0x0000_0000,
        0x8000_0000,
        0x007f_ffff,
        0x0001_8000,
    ];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..(1 << 20) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bits.push(x as u32);
    }
    let values: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let raw: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let device = Arc::clone(t.device());
    let buffer = holding(&device, &raw);
    let region = t
        .register_device_published(0, Dtype::Bf16, &buffer, 3)
        .expect("register");
    let handle = region.handle();
    assert_eq!((handle.len, handle.version), (values.len() as u64, 3));
    let mut got = vec![0u8; values.len() * 2];
    let version = runtime
        .block_on(t.read(&handle, 0..values.len(), Dest::Bytes(&mut got), deadline()))
        .expect("read");
    assert_eq!(version, 3);
    let want = codec::encode(Dtype::Bf16, &values);
    assert_eq!(got.len(), want.len());
    let wrong: Vec<usize> = (0..values.len())
        .filter(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2])
        .collect();
    assert!(
        wrong.is_empty(),
        "{} of {} elements differ from the host codec; first: f32 bits {:#010x}",
        wrong.len(),
        values.len(),
        bits[wrong[0]]
    );
}

/// C1 for publications from device memory: each one is read whole with its version; values
/// of the wrong length or of another transport's device are refused and change nothing.
#[test]
fn device_publications_are_read_whole_c1() {
    let Some((runtime, t)) =
        runtime_and_transport("device_publications_are_read_whole_c1", "publish")
    else {
        return;
    };
    let other = transport(&runtime, "publish-other");
    let device = Arc::clone(t.device());
    let n = 3 * 256 * 1024 + 5;
    let first: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let second: Vec<f32> = (0..n).map(|i| -(i as f32) - 0.5).collect();
    let a = holding(&device, &codec::encode_f32(&first));
    let b = holding(&device, &codec::encode_f32(&second));
    let region = t
        .register_device_published(7, Dtype::F32, &a, 0)
        .expect("register");
    let read = |handle: &RegionHandle| {
        let mut out = vec![f32::NAN; n];
        let version = runtime
            .block_on(t.read(handle, 0..n, Dest::F32(&mut out), deadline()))
            .expect("read");
        (version, out)
    };
    assert_eq!(read(&region.handle()), (0, first.clone()));
    region.publish_from(1, &b).expect("publish");
    assert_eq!(read(&region.handle()), (1, second.clone()));
    let short = device.alloc((n - 1) * 4).expect("alloc");
    assert!(matches!(
        region.publish_from(2, &short),
        Err(TransportError::Unsupported { .. })
    ));
    let foreign = other.device().alloc(n * 4).expect("alloc");
    assert!(matches!(
        region.publish_from(2, &foreign),
        Err(TransportError::Unsupported { .. })
    ));
    assert_eq!(region.version(), 1);
    assert_eq!(read(&region.handle()), (1, second));
}

/// A push from device memory (`accumulate_device`) adds exactly what a host accumulate adds
/// (C2), under the same fences (a repeated write id and a stale epoch are refused, C3), only
/// into an accumulator of this process, and only from memory of this device: a source that
/// runs past its allocation, or of a size that is not whole fp32s, is refused and adds
/// nothing.
#[test]
fn accumulate_from_device_memory_adds_exactly_and_is_fenced_c2_c3() {
    let Some((runtime, t)) = runtime_and_transport(
        "accumulate_from_device_memory_adds_exactly_and_is_fenced_c2_c3",
        "devpush",
    ) else {
        return;
    };
    let device = Arc::clone(t.device());
    let n = 3000;
    let acc = t.register_device_accumulator(2, n, 0).expect("register");
    let handle = acc.handle();
    let tag = |epoch, write_id| WriteTag {
        epoch,
        write_id,
        token: 0,
    };
    let ramp: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
    let src = holding(&device, &codec::encode_f32(&ramp));
    let whole = crate::DeviceDest {
        device: device.ordinal(),
        ptr: src.ptr(),
        bytes: (n * 4) as u64,
    };
    let push = |offset, dest, tag| {
        runtime.block_on(t.accumulate_device(&handle, offset, dest, tag, deadline()))
    };
    push(0, whole, tag(0, 1)).expect("a device push");
    let host = codec::encode_f32(&ramp[..100]);
    runtime
        .block_on(t.accumulate(&handle, 10, host, tag(0, 2), deadline()))
        .expect("a host push");
    assert!(matches!(
        push(0, whole, tag(0, 1)),
        Err(TransportError::DuplicateWrite { .. })
    ));
    let past = crate::DeviceDest {
        bytes: whole.bytes + 4,
        ..whole
    };
    assert!(
        push(0, past, tag(0, 3)).is_err(),
        "a source past its allocation"
    );
    let ragged = crate::DeviceDest { bytes: 6, ..whole };
    assert!(push(0, ragged, tag(0, 4)).is_err(), "half an fp32");
    assert!(
        push(n - 1, whole, tag(0, 5)).is_err(),
        "past the accumulator's end"
    );
    let mut want = ramp.clone();
    for (w, r) in want[10..110].iter_mut().zip(&ramp[..100]) {
        *w += r;
    }
    assert_eq!(
        acc.take(1),
        want,
        "the device push and the host push, nothing else"
    );
    assert!(matches!(
        push(0, whole, tag(0, 6)),
        Err(TransportError::StaleEpoch { .. })
    ));
}

/// C2 and C3 for a take into device memory: the sums of the epoch's writes arrive in the
/// owner's buffer, the accumulator starts the next epoch from zero, a late write of the old
/// epoch is refused and a write of the new one lands alone; a buffer of the wrong size is
/// refused before the epoch moves.
#[test]
fn take_into_device_memory_is_atomic_c3() {
    let Some((runtime, t)) = runtime_and_transport("take_into_device_memory_is_atomic_c3", "take")
    else {
        return;
    };
    let device = Arc::clone(t.device());
    let n = 1000;
    let acc = t.register_device_accumulator(2, n, 0).expect("register");
    let handle = acc.handle();
    let tag = |epoch, write_id| WriteTag {
        epoch,
        write_id,
        token: 0,
    };
    let add = |values: &[f32], tag: WriteTag| {
        runtime.block_on(t.accumulate(&handle, 0, codec::encode_f32(values), tag, deadline()))
    };
    let ones = vec![1.0f32; n];
    let ramp: Vec<f32> = (0..n).map(|i| i as f32).collect();
    add(&ones, tag(0, 1)).expect("first write");
    add(&ramp, tag(0, 2)).expect("second write");
    let mut wrong = device.alloc(n * 4 - 4).expect("alloc");
    assert!(acc.take_into(1, &mut wrong).is_err());
    assert_eq!(acc.epoch(), 0, "a refused take moves nothing");
    let mut into = device.alloc(n * 4).expect("alloc");
    acc.take_into(1, &mut into).expect("take");
    assert_eq!(acc.epoch(), 1);
    let sums = codec::decode_f32(&device.download(&into).expect("download")).expect("decode");
    let want: Vec<f32> = ramp.iter().map(|r| 1.0 + r).collect();
    assert_eq!(sums, want);
    assert!(matches!(
        add(&ones, tag(0, 3)),
        Err(TransportError::StaleEpoch {
            got: 0,
            current: 1,
            ..
        })
    ));
    add(&ramp, tag(1, 1)).expect("a write of the new epoch");
    assert_eq!(acc.take(2), ramp, "the new epoch started from zero");
}

/// An owner's kernels: compiled once per name, launched in stream order with buffer and
/// scalar arguments of every kind; an unknown kernel is an error.
#[test]
fn owner_modules_launch_with_every_argument_kind() {
    if skip_without_driver("owner_modules_launch_with_every_argument_kind") {
        return;
    }
    const SOURCE: &str = r#"
extern "C" __global__ void affine(float* x, unsigned long long n, float a, double b, int c) {
unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
     i += stride) {
    x[i] = (float)((double)(x[i] * a) + b) + (float)c;
}
}
"#;
    let device = device();
    let affine = odc_kernels::Source {
        name: "affine.cu",
        code: SOURCE,
        functions: &["affine"],
    };
    let module = device.module(&affine).expect("module");
    let renamed = odc_kernels::Source {
        code: "",
        functions: &[],
        ..affine
    };
    let again = device.module(&renamed).expect("cached");
    assert!(Arc::ptr_eq(&module, &again), "compiled once per name");
    let n = 5 * 256 * 1024 + 3;
    let x: Vec<f32> = (0..n).map(|i| (i % 101) as f32).collect();
    let buffer = holding(&device, &codec::encode_f32(&x));
    let args = [
        Arg::buffer(&buffer),
        Arg::u64(n as u64),
        Arg::f32(2.0),
        Arg::f64(0.5),
        Arg::i32(-3),
    ];
    // SAFETY: `affine` takes (float*, unsigned long long, float, double, int) and touches
    // the `n` elements of `buffer`.
    unsafe { device.launch(&module, "affine", n, &args) }.expect("launch");
    // SAFETY: as above, twice in a row: the second sees the first's result.
    unsafe { device.launch(&module, "affine", n, &args) }.expect("launch");
    let got = codec::decode_f32(&device.download(&buffer).expect("download")).expect("decode");
    assert_eq!(got.len(), n);
    for (i, (g, x)) in got.iter().zip(&x).enumerate() {
        let once = (x * 2.0 + 0.5) - 3.0;
        let want = (once * 2.0 + 0.5) - 3.0;
        assert_eq!(*g, want, "element {i}");
    }
    // SAFETY: the kernel does not exist: nothing is launched.
    let missing = unsafe { device.launch(&module, "nope", n, &args) };
    assert!(matches!(missing, Err(TransportError::Unsupported { .. })));
    assert!(module.blocks(1) == 1 && module.blocks(n) <= module.max_blocks());
}
