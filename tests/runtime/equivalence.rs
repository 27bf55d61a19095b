//! I3 equivalence: after K AdamW steps, the distributed run's parameters equal a plain
//! single-process loop on the same minibatches, for every trainer count, server count (uneven
//! shards), dispatch mode and pull precision.
//!
//! Tolerances: the only differences are fp32 reassociation of gradient sums (order of arrival at the
//! owners) and, for bf16 pulls, bf16 rounding of parameters that differ by that reassociation. fp32:
//! max |Δ| ≤ 1e-6; bf16 (the reference computes with the same bf16-rounded parameters): ≤ 1e-4.
//! Measured (`cargo test --test runtime -- --nocapture`): at most 4.5e-8 (fp32) and 3.0e-8 (bf16).

use std::sync::Arc;

use odc::transport::Dtype;
use odc::{DispatchMode, Precision};

use crate::model::{minibatches, reference_train, Hooks};
use crate::params::max_abs_diff;
use crate::{adamw, model_job, train, within};

const STEPS: usize = 5;

/// What the reference computes with, and the tolerance, for a pull precision.
fn reference_precision(precision: Precision) -> (Dtype, f32) {
    match precision {
        Precision::F32 => (Dtype::F32, 1e-6),
        Precision::Bf16 => (Dtype::Bf16, 1e-4),
    }
}

async fn check(trainers: usize, servers: usize, dispatch: DispatchMode, precision: Precision) {
    let data = minibatches(7, STEPS, 12, 40);
    let job = model_job(
        trainers,
        servers,
        dispatch,
        precision,
        Arc::new(Hooks::default()),
    )
    .build()
    .expect("valid job");
    let got = within(60, train(job, &data)).await;
    let (dtype, tol) = reference_precision(precision);
    let want = reference_train(&data, adamw(), dtype, None);
    let initial = reference_train(&[], adamw(), dtype, None);
    let diff = max_abs_diff(&got, &want);
    assert!(
        diff <= tol,
        "trainers={trainers} servers={servers} {dispatch:?} {precision:?}: max |Δ| = {diff} > {tol}"
    );
    eprintln!(
        "trainers={trainers} servers={servers} {dispatch:?} {precision:?}: max |Δ| = {diff:e}"
    );
    // The run must actually have trained: parameters moved by far more than the tolerance.
    let moved = max_abs_diff(&got, &initial);
    assert!(moved > 20.0 * tol, "moved only {moved}");
}

/// [`check`] for every trainer count, server count (uneven shards) and dispatch mode.
async fn check_matrix(precision: Precision) {
    for trainers in [1, 2, 4, 8] {
        for servers in [1, 3, 4] {
            for dispatch in [DispatchMode::Static, DispatchMode::Dynamic] {
                check(trainers, servers, dispatch, precision).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_equivalence_matrix_fp32() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, check_matrix(Precision::F32)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_equivalence_matrix_bf16() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, check_matrix(Precision::Bf16)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_equivalence_with_global_norm_clipping() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let data = minibatches(11, STEPS, 10, 30);
        let job = model_job(
            3,
            2,
            DispatchMode::Dynamic,
            Precision::F32,
            Arc::new(Hooks::default()),
        )
        .clip_grad_norm(0.05)
        .build()
        .unwrap();
        let got = within(60, train(job, &data)).await;
        let want = reference_train(&data, adamw(), Dtype::F32, Some(0.05));
        let unclipped = reference_train(&data, adamw(), Dtype::F32, None);
        assert!(max_abs_diff(&got, &want) <= 1e-6);
        // Clipping changed the result, so the comparison above is not vacuous.
        assert!(max_abs_diff(&want, &unclipped) > 1e-3);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_equivalence_with_sgd_and_prefetch_depths() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        let sgd = odc::OptimizerConfig::sgd(0.05);
        let data = minibatches(3, STEPS, 9, 25);
        let want = reference_train(&data, sgd, Dtype::F32, None);
        for prefetch in [0, 1, 2] {
            let job = model_job(
                2,
                3,
                DispatchMode::Dynamic,
                Precision::F32,
                Arc::new(Hooks::default()),
            )
            .optimizer(sgd)
            .prefetch(prefetch)
            .build()
            .unwrap();
            let got = within(60, train(job, &data)).await;
            assert!(max_abs_diff(&got, &want) <= 1e-6, "prefetch {prefetch}");
        }
    })
    .await
}

/// Collective mode (ring all-gather / reduce-scatter, LB-Micro with padded equal counts; two-level
/// rings in nodes of 2 from 4 trainers) trains to the same parameters as the single-process
/// reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn i3_equivalence_collective_mode() {
    // A whole-test timeout: a hang fails the test instead of CI.
    crate::within(180, async {
        for trainers in [1, 2, 4, 8] {
            for servers in [1, 3] {
                for precision in [Precision::F32, Precision::Bf16] {
                    let data = minibatches(17, STEPS, 12, 40);
                    let job = model_job(
                        trainers,
                        servers,
                        DispatchMode::Static,
                        precision,
                        Arc::new(Hooks::default()),
                    )
                    .communication(odc::Communication::Collective)
                    // Two-level rings (nodes of 2) where the trainers form more than one node.
                    .collective_node_size(if trainers >= 4 { 2 } else { 1 })
                    .build()
                    .expect("valid job");
                    let got = within(60, train(job, &data)).await;
                    let (dtype, tol) = reference_precision(precision);
                    let want = reference_train(&data, adamw(), dtype, None);
                    let diff = max_abs_diff(&got, &want);
                    assert!(
                        diff.is_finite() && diff <= tol,
                        "collective trainers={trainers} servers={servers} {precision:?}: {diff}"
                    );
                }
            }
        }
    })
    .await
}
