//! The kernels on this CPU: every source run by `odc_kernels::emulate` (compiled as C++ by the
//! host's compiler, each block's threads as fibers that meet at every shuffle, `mma.sync` and
//! barrier, every launch in two thread orders), then `cases`' checks against the references, as
//! `device.rs` runs them on a GPU. So a kernel written where no GPU is has its arithmetic,
//! indexing and every written element checked here, in CI; what only a GPU shows (its memory
//! model, timing) stays with `device.rs`.
//!
//! Without a C++ compiler each check says it was skipped, unless `ODC_REQUIRE_EMULATION=1` (CI),
//! where that fails.

use cases::{Arg, Backend};
use odc_kernels::emulate::{Emulator, BLOCK};
use odc_kernels::Source;
use rand::rngs::StdRng;

mod cases;

/// The CPU and a seeded generator, or `None` (said) without a C++ compiler.
fn cpu(test: &str) -> Option<(Emulator, StdRng)> {
    let emulator = Emulator::for_test(test)?;
    Some((emulator, cases::seeded(test)))
}

every_case!(cpu);

/// A warp whose lanes do not all reach a shuffle: undefined on a GPU, reported here; the same
/// kernel with every lane there sums the warp.
#[test]
fn a_warp_whose_lanes_part_at_a_shuffle_is_reported() {
    const SHUFFLES: Source = Source {
        name: "shuffles.cu",
        code: concat!(
            include_str!("../src/common.cuh"),
            "extern \"C\" __global__ void odc_test_sum(float* out, unsigned long long skip) {\n",
            "    unsigned int lane = threadIdx.x;\n",
            "    float v = (float)(lane & 31u);\n",
            "    if (lane != skip) v = odc_warp_sum(v);\n",
            "    out[lane] = v;\n",
            "}\n"
        ),
        functions: &["odc_test_sum"],
    };
    let Some((cpu, _)) = cpu("a_warp_whose_lanes_part_at_a_shuffle_is_reported") else {
        return;
    };
    let module = cpu.module(SHUFFLES);
    let out = cpu.poisoned(odc_transport::Dtype::F32, BLOCK as usize);
    let run = |skip: u64| {
        // SAFETY: `odc_test_sum(float* out, unsigned long long skip)`, `out` of a block's floats.
        unsafe {
            cpu.launch(
                &module,
                "odc_test_sum",
                BLOCK as usize,
                &[Arg::buffer(&out), Arg::u64(skip)],
            )
        }
    };
    run(u64::from(BLOCK)).expect("every lane at the shuffle");
    assert_eq!(
        cpu.download(odc_transport::Dtype::F32, &out),
        vec![496.0; BLOCK as usize]
    );
    let parted = run(3).expect_err("lane 3 skips the shuffle");
    assert!(parted.contains("parted at a shuffle"), "{parted}");
}

/// A block that reads shared memory another thread wrote without a barrier between: its result
/// depends on the order the threads run, which is reported; with the barrier it is not. (Shared
/// memory keeps the last launch's values here: the run without the barrier writes others, so
/// the ascending order reads stale cells.)
#[test]
fn a_shared_memory_race_is_reported() {
    const RACE: Source = Source {
        name: "race.cu",
        code: concat!(
            include_str!("../src/common.cuh"),
            "extern \"C\" __global__ void odc_test_neighbour(float* out, unsigned long long sync) {\n",
            "    __shared__ float cell[1024];\n",
            "    unsigned int i = threadIdx.x;\n",
            "    cell[i] = (float)i + (sync ? 1000.0f : 0.0f);\n",
            "    if (sync) __syncthreads();\n",
            "    out[i] = cell[(i + 1) % blockDim.x];\n",
            "}\n"
        ),
        functions: &["odc_test_neighbour"],
    };
    let Some((cpu, _)) = cpu("a_shared_memory_race_is_reported") else {
        return;
    };
    let module = cpu.module(RACE);
    let out = cpu.poisoned(odc_transport::Dtype::F32, BLOCK as usize);
    let run = |sync: u64| {
        // SAFETY: `odc_test_neighbour(float* out, unsigned long long sync)`, `out` of a block's
        // floats.
        unsafe {
            cpu.launch(
                &module,
                "odc_test_neighbour",
                BLOCK as usize,
                &[Arg::buffer(&out), Arg::u64(sync)],
            )
        }
    };
    run(1).expect("with the barrier");
    let want: Vec<f32> = (0..BLOCK)
        .map(|i| ((i + 1) % BLOCK) as f32 + 1000.0)
        .collect();
    assert_eq!(cpu.download(odc_transport::Dtype::F32, &out), want);
    let raced = run(0).expect_err("without the barrier");
    assert!(raced.contains("another order"), "{raced}");
}
