//! The GPU shard servers' barrier kernels (odc-kernels' `optimizer.cu`) on this CPU: the servers'
//! own interface to them ([`OptimizerKernels`], the lengths checked, the launches made) on
//! `odc_kernels::emulate` (the CUDA C compiled as C++, a block's threads as fibers, every launch in
//! two thread orders) instead of a GPU. Written to be bitwise the host's loops, they must equal
//! them bit for bit —
//! the scaling of the summed gradient, AdamW (weight decay, bias correction, clipping) and SGD
//! in its three modes — against `odc_policy::optimizer` on fresh random values, over a length
//! that is no multiple of a block, with every output poisoned first; the block's sum of squares
//! within 1e-12 relative of the host's (another order of f64 additions), NaN when a gradient is.
//! `tests/gpu_servers.rs` runs the same kernels on a GPU; this runs in CI.
//!
//! Without a C++ compiler each test says it was skipped, unless `ODC_REQUIRE_EMULATION=1` (CI).

use odc_actors::policy::optimizer::{OptimizerConfig, OptimizerState, StepScalars};
use odc_actors::server::optimizer_kernels::{OptimizerKernels, SgdMomentum};
use odc_kernels::emulate::{Emulator, HostBuffer};
use rand::{Rng, SeedableRng};

/// Elements: several grid-stride passes of a block and no round number.
const LEN: usize = 3 * 256 + 37;

/// The kernels loaded on the CPU's emulation and a seeded generator, or `None` (said) without a
/// compiler.
fn setup(test: &str) -> Option<(OptimizerKernels<Emulator>, rand::rngs::StdRng)> {
    let emulator = Emulator::for_test(test)?;
    let kernels = OptimizerKernels::new(emulator).unwrap_or_else(|e| panic!("{e}"));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    eprintln!("{test}: seed {seed}");
    Some((kernels, rand::rngs::StdRng::seed_from_u64(seed)))
}

fn random(rng: &mut impl Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

fn buffer(values: &[f32]) -> HostBuffer {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    HostBuffer::from_bytes(&bytes)
}

fn floats(buffer: &HostBuffer) -> Vec<f32> {
    buffer
        .to_bytes()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `got` equals `want` bit for bit.
fn assert_bitwise(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: element {i} is {} on the kernel, {} on the host",
            got[i], want[i]
        );
    }
}

/// `g` as the server's apply clips it (`shard.rs`): `(g as f64 · clip) as f32` unless clip is 1.
fn clipped(grads: &[f32], clip: f64) -> Vec<f32> {
    grads
        .iter()
        .map(|&g| {
            if clip != 1.0 {
                (g as f64 * clip) as f32
            } else {
                g
            }
        })
        .collect()
}

#[test]
fn the_scaled_gradient_and_its_sum_of_squares_are_the_hosts() {
    let Some((mut kernels, mut rng)) =
        setup("the_scaled_gradient_and_its_sum_of_squares_are_the_hosts")
    else {
        return;
    };
    let grads = random(&mut rng, LEN, 3.0);
    let scale = 1.0 / 7.0;
    let grad = buffer(&grads);
    let sum = kernels
        .scale_sum_sq(&grad, scale)
        .expect("odc_scale_sum_sq");
    let want: Vec<f32> = grads.iter().map(|&g| (g as f64 * scale) as f32).collect();
    assert_bitwise("scaled gradient", &floats(&grad), &want);
    let host: f64 = want.iter().map(|&g| (g as f64) * (g as f64)).sum();
    let rel = ((sum - host) / host).abs();
    println!("sum of squares: kernel {sum}, host {host}, relative {rel:e}");
    assert!(
        rel <= 1e-12,
        "sum of squares {sum} against the host's {host}"
    );
    // A NaN gradient makes the sum NaN.
    let mut with_nan = grads.clone();
    with_nan[LEN - 3] = f32::NAN;
    let grad = buffer(&with_nan);
    let sum = kernels
        .scale_sum_sq(&grad, scale)
        .expect("odc_scale_sum_sq");
    assert!(sum.is_nan(), "a NaN gradient summed to {sum}");
    // A buffer that is not fp32 elements is refused before anything runs.
    let odd = HostBuffer::from_bytes(&[0u8; 6]);
    let e = kernels.scale_sum_sq(&odd, scale).unwrap_err().to_string();
    assert!(e.contains("not fp32 elements"), "{e}");
}

#[test]
fn adamw_on_the_kernel_is_the_hosts_bit_for_bit() {
    let Some((kernels, mut rng)) = setup("adamw_on_the_kernel_is_the_hosts_bit_for_bit") else {
        return;
    };
    let config = OptimizerConfig::AdamW {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut state = OptimizerState::new(&config, LEN);
    let mut host = random(&mut rng, LEN, 1.0);
    let (param, exp_avg, exp_avg_sq) = (buffer(&host), buffer(&[0.0; LEN]), buffer(&[0.0; LEN]));
    // Three steps, the second clipped.
    for (step, clip) in [(0u64, 1.0), (1, 0.37), (2, 1.0)] {
        let grads = random(&mut rng, LEN, 2.0);
        let StepScalars::AdamW(s) =
            odc_actors::policy::optimizer::plan_step(&config, state.name(), LEN, step, LEN, LEN)
                .expect("a step")
        else {
            panic!("AdamW's scalars");
        };
        let grad = buffer(&grads);
        kernels
            .adamw(&s, clip, &param, &grad, &exp_avg, &exp_avg_sq)
            .expect("odc_adamw");
        state
            .step(&config, &mut host, &clipped(&grads, clip))
            .expect("the host's step");
        assert_bitwise(
            &format!("AdamW step {} parameters", step + 1),
            &floats(&param),
            &host,
        );
        let buffers = state.buffers();
        assert_bitwise("exp_avg", &floats(&exp_avg), buffers[0]);
        assert_bitwise("exp_avg_sq", &floats(&exp_avg_sq), buffers[1]);
    }
}

#[test]
fn sgd_on_the_kernel_is_the_hosts_bit_for_bit_in_each_mode() {
    let Some((kernels, mut rng)) = setup("sgd_on_the_kernel_is_the_hosts_bit_for_bit_in_each_mode")
    else {
        return;
    };
    for (momentum, weight_decay) in [(0.0f32, 0.0f32), (0.0, 0.01), (0.9, 0.0), (0.9, 0.01)] {
        let config = OptimizerConfig::Sgd {
            lr: 0.05,
            momentum,
            weight_decay,
        };
        let mut state = OptimizerState::new(&config, LEN);
        let mut host = random(&mut rng, LEN, 1.0);
        let (param, buf) = (buffer(&host), buffer(&[f32::NAN; LEN]));
        for (step, clip) in [(0u64, 1.0), (1, 0.5), (2, 1.0)] {
            let grads = random(&mut rng, LEN, 2.0);
            // No momentum: the buffer untouched; the momentum buffer's first step; after it.
            let mode = match (momentum == 0.0, step) {
                (true, _) => SgdMomentum::Off,
                (false, 0) => SgdMomentum::First(&buf),
                (false, _) => SgdMomentum::Next(&buf),
            };
            let grad = buffer(&grads);
            kernels
                .sgd(0.05, momentum, weight_decay, clip, &param, &grad, mode)
                .expect("odc_sgd");
            state
                .step(&config, &mut host, &clipped(&grads, clip))
                .expect("the host's step");
            let what = format!(
                "SGD momentum {momentum} decay {weight_decay} step {}",
                step + 1
            );
            assert_bitwise(&what, &floats(&param), &host);
            match state.buffers().first() {
                Some(want) => assert_bitwise(&format!("{what} buffer"), &floats(&buf), want),
                None => assert!(
                    floats(&buf).iter().all(|b| b.is_nan()),
                    "{what}: the buffer was written without momentum"
                ),
            }
        }
    }
}
