//! Joining and starting multi-process jobs: [`World`] reads this process's rank, world size and
//! coordinator from the environment (odc's own variables, torchrun's or Slurm's); [`launch`]
//! starts a local multi-process job (`odc launch`).

mod spawn;
mod world;

pub use spawn::{launch, LaunchConfig, LaunchError, TIMED_OUT};
pub use world::{first_host, World, WorldError, WorldSource, DEFAULT_PORT, MAX_WORLD};
