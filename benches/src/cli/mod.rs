//! The subcommands of `odc-bench`, one file each; here what several of them share (the limits'
//! value parsers, device selection).

use odc_bench::input::{self, MAX_DEVICES, MAX_MINIBATCH_PER_DEVICE, MAX_SEQUENCE_TOKENS};

mod ab;
mod calibrate;
mod checkpoint_io;
mod checkpoint_step;
mod gang;
mod generate;
mod hf;
mod lora_traffic;
mod memory;
mod noise;
mod processes;
mod sft_overhead;
mod sim;
mod transport;

pub(crate) use ab::*;
pub(crate) use calibrate::*;
pub(crate) use checkpoint_io::*;
pub(crate) use checkpoint_step::*;
pub(crate) use gang::*;
pub(crate) use generate::*;
pub(crate) use hf::*;
pub(crate) use lora_traffic::*;
pub(crate) use memory::*;
pub(crate) use noise::*;
pub(crate) use processes::*;
pub(crate) use sft_overhead::*;
pub(crate) use sim::*;
pub(crate) use transport::*;

pub(crate) fn devices(s: &str) -> Result<usize, String> {
    input::count(s, MAX_DEVICES)
}
pub(crate) fn per_device(s: &str) -> Result<usize, String> {
    input::count(s, MAX_MINIBATCH_PER_DEVICE)
}
pub(crate) fn steps(s: &str) -> Result<u64, String> {
    input::count(s, input::MAX_STEPS)
}
pub(crate) fn reps(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_REPS)
}
pub(crate) fn units(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_UNITS)
}
pub(crate) fn unit_elems(s: &str) -> Result<usize, String> {
    input::count(s, input::MAX_UNIT_ELEMS)
}
pub(crate) fn token_budget(s: &str) -> Result<u64, String> {
    input::count(s, MAX_SEQUENCE_TOKENS).map_err(|e| format!("{e} (the maximum sequence length)"))
}
pub(crate) fn time_scale(s: &str) -> Result<f64, String> {
    input::milliseconds(s, false)
}
pub(crate) fn transfer(s: &str) -> Result<f64, String> {
    input::milliseconds(s, true)
}

/// The first value of `values` that appears twice.
pub(crate) fn repeated<T: PartialEq + Copy>(values: &[T]) -> Option<T> {
    values
        .iter()
        .enumerate()
        .find(|(i, v)| values[..*i].contains(v))
        .map(|(_, v)| *v)
}

/// `--device` and `--precision` (bf16 by default on CUDA).
pub(crate) fn device_and_precision(
    device: &str,
    precision: Option<&str>,
) -> anyhow::Result<(odc::model::DeviceSpec, odc::model::ComputePrecision)> {
    let device: odc::model::DeviceSpec = device.parse()?;
    let precision = match precision {
        Some(p) => p.parse()?,
        None if device.is_cuda() => odc::model::ComputePrecision::Bf16,
        None => odc::model::ComputePrecision::F32,
    };
    Ok((device, precision))
}
