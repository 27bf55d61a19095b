//! This process's part of a run. [`Process::start`] reads the launcher's world (torchrun's,
//! Slurm's or `odc launch`'s variables; a world of one without them) and gives each trainer of
//! this process its share of the host's cores, before any thread exists; [`Process::runtime`]
//! is the tokio runtime the run then blocks on.
//!
//! Guarantees:
//! - Rank 0 is the **lead**: it alone prints ([`Process::say`]); the recipes' entries also let
//!   it alone evaluate, checkpoint and export.
//! - Under a launcher (a world of more than one) every process holds one trainer; alone it
//!   holds the trainers asked for.
//! - Each rank serves its metrics on the given port plus its rank, so that the ranks of one host
//!   do not collide (port 0 stays 0: the system picks one).
//! - It installs the fault injection the multi-process tests ask a launched program for
//!   (`odc_actors::faults::Faults::from_env`; unset, nothing is held).

use std::fmt::Display;
use std::net::SocketAddr;

use super::{RecipeError, Result};
use crate::launch::World;
#[cfg(feature = "candle")]
use crate::model::{share_cpu_threads, CpuThreads};

/// This process's part of a run: its rank in the world and its share of the cores.
#[derive(Debug, Clone)]
pub struct Process {
    /// The launcher's world (a world of one without a launcher).
    pub world: World,
    /// What `share_cpu_threads` decided for this process's trainers (`None`: an embedded
    /// process, whose host program sizes its own threads).
    #[cfg(feature = "candle")]
    pub threads: Option<CpuThreads>,
    trainers_here: usize,
}

impl Process {
    /// Call first in `main`, before any thread (a tokio runtime, a candle op) exists: it sets the
    /// thread pools' sizes through environment variables. `trainers` is how many trainers the
    /// process holds when it runs alone; under a launcher it holds one.
    pub fn start(trainers: usize) -> Result<Process> {
        let world = World::from_env().map_err(RecipeError::World)?;
        // The multi-process tests' fault injection, asked for by variables (none when unset).
        odc_actors::faults::install(odc_actors::faults::Faults::from_env());
        Ok(Process::of(world, trainers))
    }

    /// [`Process::start`] for a program that hosts odc in a process of its own (Python, with
    /// PyTorch's threads running): it reads the world and installs the fault injection, and
    /// sets no environment variable (setting one while other threads run is unsound), so candle's
    /// pools keep their sizes and the host's compute keeps its own.
    pub fn embedded(trainers: usize) -> Result<Process> {
        let world = World::from_env().map_err(RecipeError::World)?;
        odc_actors::faults::install(odc_actors::faults::Faults::from_env());
        Ok(Process::placed(world, trainers))
    }

    /// [`Process::start`] for a given world.
    pub fn of(world: World, trainers: usize) -> Process {
        #[allow(unused_mut)] // without candle there are no pools to size
        let mut process = Process::placed(world, trainers);
        #[cfg(feature = "candle")]
        {
            process.threads = Some(share_cpu_threads(process.trainers_here));
        }
        process
    }

    fn placed(world: World, trainers: usize) -> Process {
        let trainers_here = if world.world_size > 1 { 1 } else { trainers };
        Process {
            world,
            #[cfg(feature = "candle")]
            threads: None,
            trainers_here,
        }
    }

    /// The multi-threaded tokio runtime the run blocks on.
    pub fn runtime(&self) -> Result<tokio::runtime::Runtime> {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|source| RecipeError::Io {
                context: "starting the tokio runtime".into(),
                source,
            })
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.world.rank
    }

    /// Processes in the world (at least 1).
    pub fn ranks(&self) -> u32 {
        self.world.world_size.max(1)
    }

    /// Whether other processes share the job (under a launcher).
    pub fn is_distributed(&self) -> bool {
        self.world.world_size > 1
    }

    /// Whether this is rank 0, which prints, evaluates, checkpoints and exports.
    pub fn is_lead(&self) -> bool {
        self.world.rank == 0
    }

    /// Trainers this process holds.
    pub fn trainers_here(&self) -> usize {
        self.trainers_here
    }

    /// Prints `line` on the lead.
    pub fn say(&self, line: impl Display) {
        if self.is_lead() {
            println!("{line}");
        }
    }

    /// Serves Prometheus metrics on `addr`'s port plus this rank (inside the runtime), says
    /// where, and returns the address.
    pub fn serve_metrics(&self, addr: SocketAddr) -> Result<SocketAddr> {
        let addr = rank_port(addr, self.rank());
        crate::metrics::serve(addr)?;
        self.say(format!("metrics: http://{addr}/metrics"));
        Ok(addr)
    }
}

/// `addr` with its port moved up by `rank` (port 0 stays 0).
fn rank_port(mut addr: SocketAddr, rank: u32) -> SocketAddr {
    if addr.port() != 0 {
        let rank = u16::try_from(rank).unwrap_or(u16::MAX);
        addr.set_port(addr.port().saturating_add(rank));
    }
    addr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_serves_metrics_on_the_port_plus_its_rank() {
        let addr: SocketAddr = "127.0.0.1:9464".parse().unwrap();
        assert_eq!(rank_port(addr, 0).port(), 9464);
        assert_eq!(rank_port(addr, 3).port(), 9467);
        assert_eq!(rank_port("127.0.0.1:0".parse().unwrap(), 3).port(), 0);
        assert_eq!(
            rank_port("127.0.0.1:65535".parse().unwrap(), 3).port(),
            65535
        );
    }
}
