//! Which rank hosts which shard servers and trainers in a multi-process job. The default, as a
//! GPU does in ODC: every rank hosts one server and one trainer.

use std::fmt;

/// Where the servers and trainers of a multi-process job live: `server_ranks[e]` is the rank of
/// shard server `e`, `trainer_ranks[t]` the rank of trainer slot `t`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    pub server_ranks: Vec<u32>,
    pub trainer_ranks: Vec<u32>,
}

impl Roles {
    /// One server and one trainer on every rank.
    pub fn one_each(world_size: u32) -> Self {
        Roles::round_robin(world_size as usize, world_size as usize, world_size)
    }

    /// `trainers` trainers and `servers` servers dealt over the ranks in turn (trainer `t` on rank
    /// `t % world_size`).
    pub fn round_robin(trainers: usize, servers: usize, world_size: u32) -> Self {
        let world = world_size.max(1) as usize;
        Roles {
            server_ranks: (0..servers).map(|e| (e % world) as u32).collect(),
            trainer_ranks: (0..trainers).map(|t| (t % world) as u32).collect(),
        }
    }

    /// Explicit rank lists; `servers_on[e]` hosts server `e`, `trainers_on[t]` trainer `t`.
    pub fn explicit(servers_on: Vec<u32>, trainers_on: Vec<u32>) -> Self {
        Roles {
            server_ranks: servers_on,
            trainer_ranks: trainers_on,
        }
    }

    /// Every rank is below `world_size` and there is at least one server and one trainer.
    pub fn validate(&self, world_size: u32) -> Result<(), String> {
        if self.server_ranks.is_empty() || self.trainer_ranks.is_empty() {
            return Err(format!(
                "{self}: a job needs at least one server and one trainer"
            ));
        }
        for (what, ranks) in [
            ("server", &self.server_ranks),
            ("trainer", &self.trainer_ranks),
        ] {
            if let Some((i, r)) = ranks.iter().enumerate().find(|(_, r)| **r >= world_size) {
                return Err(format!(
                    "{what} {i} is placed on rank {r}, but the world has {world_size} ranks"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        write!(
            f,
            "servers on ranks [{}], trainers on ranks [{}]",
            list(&self.server_ranks),
            list(&self.trainer_ranks)
        )
    }
}

/// A comma-separated list of ranks (`"0,1,2"`), as the examples take it.
pub fn parse_ranks(text: &str) -> Result<Vec<u32>, String> {
    text.split(',')
        .map(|r| {
            r.trim()
                .parse::<u32>()
                .map_err(|e| format!("{r:?} in {text:?} is not a rank: {e}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_one_server_and_one_trainer_per_rank() {
        let r = Roles::one_each(4);
        assert_eq!(r.server_ranks, [0, 1, 2, 3]);
        assert_eq!(r.trainer_ranks, [0, 1, 2, 3]);
        assert!(r.validate(4).is_ok());
    }

    #[test]
    fn round_robin_wraps_and_explicit_is_checked_against_the_world() {
        let r = Roles::round_robin(5, 2, 3);
        assert_eq!(r.trainer_ranks, [0, 1, 2, 0, 1]);
        assert_eq!(r.server_ranks, [0, 1]);
        let e = Roles::explicit(vec![0, 4], vec![0])
            .validate(4)
            .unwrap_err();
        assert!(e.contains("server 1 is placed on rank 4"), "{e}");
        assert!(Roles::explicit(vec![], vec![0]).validate(1).is_err());
        assert_eq!(parse_ranks("0, 2,3").unwrap(), [0, 2, 3]);
        assert!(parse_ranks("0,x").unwrap_err().contains("\"x\""));
    }
}
