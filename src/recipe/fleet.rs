//! How many trainers and shard servers a job has, and where: [`Fleet`]. Alone, a process holds
//! `trainers` trainers and `servers` servers; under a launcher every rank holds one of each,
//! unless `servers_on` / `trainers_on` list the ranks that do (`0,1`, as `odc launch` and the
//! examples' `--servers-on` / `--trainers-on` take them).

use super::{RecipeError, Result};
use crate::launch::{parse_ranks, Roles, World};
use crate::JobBuilder;

/// The job's trainers and shard servers (see the [module docs](self)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    /// Trainers in one process.
    pub trainers: usize,
    /// Shard servers in one process.
    pub servers: usize,
    /// Under a launcher: the ranks of the shard servers (`None`: one on every rank).
    pub servers_on: Option<String>,
    /// Under a launcher: the ranks of the trainers (`None`: one on every rank).
    pub trainers_on: Option<String>,
}

impl Fleet {
    /// `trainers` and `servers` in one process, one of each per rank under a launcher.
    pub fn new(trainers: usize, servers: usize) -> Fleet {
        Fleet {
            trainers,
            servers,
            servers_on: None,
            trainers_on: None,
        }
    }

    /// Refuses a rank list that does not parse, naming its flag.
    pub fn check(&self) -> Result<()> {
        self.server_ranks(1)?;
        self.trainer_ranks(1)?;
        Ok(())
    }

    /// Trainers of the job, over every rank of a world of `world_size`.
    pub fn trainers(&self, world_size: u32) -> usize {
        match world_size > 1 {
            true => self.trainer_ranks(world_size).map_or(1, |r| r.len()),
            false => self.trainers,
        }
    }

    /// The fleet on `builder`: alone, its trainers and servers; under a launcher, the world and
    /// the explicit roles when a rank list is given.
    pub fn apply(&self, builder: JobBuilder, world: &World) -> Result<JobBuilder> {
        if world.world_size <= 1 {
            return Ok(builder.trainers(self.trainers).servers(self.servers));
        }
        let builder = builder.world(world.clone());
        if self.servers_on.is_none() && self.trainers_on.is_none() {
            return Ok(builder);
        }
        Ok(builder.roles(Roles::explicit(
            self.server_ranks(world.world_size)?,
            self.trainer_ranks(world.world_size)?,
        )))
    }

    fn server_ranks(&self, world_size: u32) -> Result<Vec<u32>> {
        ranks("servers-on", self.servers_on.as_deref(), world_size)
    }

    fn trainer_ranks(&self, world_size: u32) -> Result<Vec<u32>> {
        ranks("trainers-on", self.trainers_on.as_deref(), world_size)
    }
}

/// The ranks `text` lists, or every rank of the world.
fn ranks(flag: &str, text: Option<&str>, world_size: u32) -> Result<Vec<u32>> {
    match text {
        Some(text) => parse_ranks(text).map_err(|e| RecipeError::Invalid(format!("--{flag}: {e}"))),
        None => Ok((0..world_size).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trainers_count_over_every_rank_and_a_bad_list_names_its_flag() {
        let alone = Fleet::new(3, 2);
        assert_eq!(alone.trainers(1), 3);
        assert_eq!(alone.trainers(4), 4);
        let listed = Fleet {
            trainers_on: Some("0,2".into()),
            ..Fleet::new(3, 2)
        };
        assert_eq!(listed.trainers(4), 2);
        let bad = Fleet {
            servers_on: Some("0,x".into()),
            ..Fleet::new(1, 1)
        };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.starts_with("--servers-on: "), "{e}");
        assert!(Fleet::new(1, 1).check().is_ok());
    }
}
