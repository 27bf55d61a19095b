//! Where the trainers compute, from the words of an entry's flags: `--device` (`cpu`, `cuda`,
//! `cuda:N`), `--precision` (`f32`, `bf16`), `--reshard-after-forward` (`auto`, `true`, `false`,
//! `N`) and `--host-transfers`. A word the model does not take is an error naming the flag and
//! the word; the local rank is the launcher's (`ODC_LOCAL_RANK`, torchrun's `LOCAL_RANK`).
//! And the peak the run's MFU is over ([`peak`]), which depends on where the trainers compute.

use super::progress::Peak;
use super::{RecipeError, Result};
use crate::compute::{DeviceTransfers, Placement};
use crate::model::Reshard;

/// The peak a run's MFU is over: `--peak-tflops` when given; on a GPU an H100/H200's bf16 dense
/// peak; on the CPU the fp32 matmul rate this process's `trainers` reach together, measured now
/// (about 0.3 s).
pub fn peak(placement: &Placement, given: Option<f64>, trainers: usize) -> Result<Peak> {
    if let Some(tflops) = given {
        return Peak::given(tflops).map_err(RecipeError::Invalid);
    }
    if placement.device.is_cuda() {
        return Ok(Peak::h100());
    }
    let flops = crate::model::matmul_rate(trainers)?;
    Ok(Peak {
        flops,
        source: format!(
            "this CPU's measured fp32 matmul rate with {trainers} trainer(s), {:.1} GFLOP/s",
            flops / 1e9
        ),
    })
}

/// The trainers' placement for these flags' values.
pub fn placement(
    device: &str,
    precision: &str,
    reshard_after_forward: &str,
    host_transfers: bool,
) -> Result<Placement> {
    Ok(Placement {
        device: device.parse()?,
        precision: precision.parse()?,
        reshard: reshard_after_forward
            .parse::<Reshard>()
            .map_err(|e| RecipeError::Invalid(format!("--{e}")))?,
        local_rank: crate::launch::local_rank(),
        implementations: Default::default(),
        transfers: match host_transfers {
            true => DeviceTransfers::Host,
            false => DeviceTransfers::Device,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ComputePrecision, DeviceSpec};

    #[test]
    fn the_flags_words_become_a_placement_and_a_bad_word_names_its_flag() {
        let p = placement("cuda:1", "bf16", "2", true).unwrap();
        assert_eq!(p.device, DeviceSpec::Cuda(Some(1)));
        assert_eq!(p.precision, ComputePrecision::Bf16);
        assert_eq!(p.reshard, Reshard::KeepLast(2));
        assert_eq!(p.transfers, DeviceTransfers::Host);
        let cpu = placement("cpu", "f32", "auto", false).unwrap();
        assert_eq!(cpu.transfers, DeviceTransfers::Device);
        for (args, names) in [
            (("gpu", "f32", "auto"), "expected cpu, cuda or cuda:N"),
            (("cpu", "f16", "auto"), "expected f32 or bf16"),
            (
                ("cpu", "f32", "sometimes"),
                "--reshard-after-forward is auto",
            ),
        ] {
            let e = placement(args.0, args.1, args.2, false)
                .unwrap_err()
                .to_string();
            assert!(e.contains(names), "{args:?}: {e}");
        }
    }

    #[test]
    fn the_peak_is_the_flag_the_card_or_the_cpus_measured_rate() {
        let cpu = placement("cpu", "f32", "auto", false).unwrap();
        let gpu = placement("cuda", "bf16", "auto", false).unwrap();
        assert_eq!(peak(&gpu, None, 1).unwrap(), Peak::h100());
        assert_eq!(peak(&cpu, Some(1.5), 1).unwrap().flops, 1.5e12);
        let err = peak(&cpu, Some(0.0), 1).unwrap_err().to_string();
        assert!(err.contains("--peak-tflops"), "{err}");
        let measured = peak(&cpu, None, 1).unwrap();
        // Any CPU that runs these tests multiplies faster than 0.1 GFLOP/s and slower than a GPU.
        assert!(
            measured.flops > 1e8 && measured.flops < 1e14,
            "{measured:?}"
        );
        assert!(measured.source.contains("measured"), "{measured:?}");
    }
}
