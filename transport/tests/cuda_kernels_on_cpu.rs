//! The `cuda` backend's device kernels (`src/cuda/kernels.cu`) on this CPU, through
//! `odc_kernels::emulate` (the CUDA C compiled as C++, a block's threads as fibers, every launch in
//! two thread orders). They are written to be the host codec bit for bit: the fp32 and bf16
//! accumulates equal `codec::add_f32_into` (and `codec::decode` of bf16 then the same add), the
//! bf16 encode equals `codec::encode`, over values that include NaNs, infinities, subnormals and
//! exact rounding ties, with a length that is no multiple of a block. The cuda unit tests run the
//! same kernels on a GPU; this runs in CI.
//!
//! Without a C++ compiler each test says it was skipped, unless `ODC_REQUIRE_EMULATION=1` (CI).

use std::sync::Arc;

use odc_kernels::emulate::{Arg, Emulator, HostBuffer, Module};
use odc_transport::{codec, Dtype};

const SOURCE: &str = include_str!("../src/cuda/kernels.cu");
const LEN: usize = 3 * 256 + 29;

fn setup(test: &str) -> Option<Arc<Module>> {
    let emulator = Emulator::for_test(test)?;
    Some(
        emulator
            .compile("kernels.cu", SOURCE)
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

/// `LEN` values from bit patterns of every kind: normal, subnormal, ±0, ±∞, NaNs (quiet and
/// signalling), exact bf16 ties (odd and even), from a splitmix64 sequence.
fn values(seed: u64) -> Vec<f32> {
    let special = [
        0.0f32,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0x0000_8000),
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
        f32::MIN_POSITIVE,
    ];
    let mut z = seed;
    (0..LEN)
        .map(|i| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^= x >> 31;
            match i % 4 {
                0 => special[(x as usize) % special.len()],
                1 => f32::from_bits(x as u32),
                _ => (x as u32 as f32 / u32::MAX as f32 - 0.5) * 8.0,
            }
        })
        .collect()
}

fn bits(buffer: &HostBuffer) -> Vec<u8> {
    buffer.to_bytes()
}

#[test]
fn the_accumulates_are_the_host_codecs_bit_for_bit() {
    let Some(module) = setup("the_accumulates_are_the_host_codecs_bit_for_bit") else {
        return;
    };
    let acc = values(1);
    for dtype in [Dtype::F32, Dtype::Bf16] {
        let src = codec::encode(dtype, &values(2));
        let mut want = acc.clone();
        let widened = codec::encode_f32(&codec::decode(dtype, &src).expect("decode"));
        codec::add_f32_into(&widened, &mut want).expect("the host's add");
        let (out, input) = (
            HostBuffer::from_bytes(&codec::encode_f32(&acc)),
            HostBuffer::from_bytes(&src),
        );
        let function = match dtype {
            Dtype::F32 => "odc_add_f32",
            Dtype::Bf16 => "odc_add_bf16",
        };
        // SAFETY: `odc_add_*(float* acc, const T* src, unsigned long long n)`; both hold LEN
        // elements.
        unsafe {
            let args = [Arg::Buffer(&out), Arg::Buffer(&input), Arg::U64(LEN as u64)];
            module.launch(function, &args).expect(function);
        }
        assert_eq!(
            bits(&out),
            codec::encode_f32(&want).to_vec(),
            "{function}: not the host's sums bit for bit"
        );
    }
}

#[test]
fn the_bf16_encode_is_the_host_codecs_bit_for_bit() {
    let Some(module) = setup("the_bf16_encode_is_the_host_codecs_bit_for_bit") else {
        return;
    };
    let src = values(3);
    let (out, input) = (
        HostBuffer::from_bytes(&vec![0xa5u8; LEN * 2]),
        HostBuffer::from_bytes(&codec::encode_f32(&src)),
    );
    // SAFETY: `odc_encode_bf16(unsigned short* dst, const float* src, unsigned long long n)`;
    // dst holds LEN bf16, src LEN floats.
    unsafe {
        let args = [Arg::Buffer(&out), Arg::Buffer(&input), Arg::U64(LEN as u64)];
        module
            .launch("odc_encode_bf16", &args)
            .expect("odc_encode_bf16");
    }
    let want = codec::encode(Dtype::Bf16, &src);
    let got = bits(&out);
    if let Some(i) = (0..LEN).find(|&i| got[2 * i..2 * i + 2] != want[2 * i..2 * i + 2]) {
        panic!(
            "element {i} ({:#010x}) encodes to {:02x?} on the kernel, {:02x?} on the host",
            src[i].to_bits(),
            &got[2 * i..2 * i + 2],
            &want[2 * i..2 * i + 2]
        );
    }
}
