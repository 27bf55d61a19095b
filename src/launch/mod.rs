//! Joining and starting multi-process jobs: [`World`] reads this process's rank, world size and
//! coordinator from the environment (odc's own variables, torchrun's or Slurm's); [`Roles`] says
//! which rank hosts which servers and trainers; [`transport`] makes this process's data plane;
//! [`launch`] starts a local multi-process job (`odc launch`); [`raise_fd_limit`] raises the
//! descriptor limit a job's connections need.

mod limits;
mod roles;
mod spawn;
mod transport;
mod world;

pub use limits::raise_fd_limit;
pub use roles::{parse_ranks, Roles};
pub use spawn::{launch, LaunchConfig, LaunchError, TIMED_OUT};
pub use transport::{device_transport, job_name, local_device, local_rank, secret, transport};
pub use world::{first_host, World, WorldError, WorldSource, DEFAULT_PORT, MAX_WORLD};
