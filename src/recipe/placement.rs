//! Where the trainers compute, from the words of an entry's flags: `--device` (`cpu`, `cuda`,
//! `cuda:N`), `--precision` (`f32`, `bf16`), `--reshard-after-forward` (`auto`, `true`, `false`,
//! `N`) and `--host-transfers`. A word the model does not take is an error naming the flag and
//! the word; the local rank is the launcher's (`ODC_LOCAL_RANK`, torchrun's `LOCAL_RANK`).

use super::{RecipeError, Result};
use crate::compute::{DeviceTransfers, Placement};
use crate::model::Reshard;

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
}
