//! A job's sharded checkpoint ([`Job::save_checkpoint`]): written by the shard servers, each from
//! its own memory, and published by the caller ([`crate::checkpoint::sharded`]).

use std::path::{Path, PathBuf};

use odc_actors::messages::WriteShardsCmd;
use odc_actors::supervisor::SupervisorMsg;
use odc_actors::{Error, Result};

use crate::checkpoint::{sharded, CheckpointError, TensorMap};

use super::*;

fn checkpoint_error(e: CheckpointError) -> Error {
    Error::Checkpoint {
        path: match &e {
            CheckpointError::Io { path, .. } | CheckpointError::Invalid { path, .. } => {
                path.display().to_string()
            }
            CheckpointError::Map(_) => "checkpoint".into(),
        },
        reason: e.to_string(),
    }
}

impl Job {
    /// Writes a checkpoint of the job's state at its current step into `dir/step-<N>`, sharded:
    /// every shard server writes its own shards (fp32 masters and optimizer state, from host or
    /// device memory) as one synced file in a staging directory this process creates, and this
    /// process adds `state.json` (with `extra`) and the manifest — the servers' own sizes and
    /// CRC32Cs — and renames it into place: no byte of another server's shards passes through
    /// it. `tensors` names the model's tensors (a check on load). Every process hosting a server
    /// must see `dir` at the same path (one host, or a shared filesystem). [`checkpoint::load`]
    /// reads it back whole, so a job resumes from it with any number of servers.
    ///
    /// Waits for every server's write, at most the parameters timeout
    /// ([`JobBuilder::parameters_timeout`]); call it between steps.
    ///
    /// [`checkpoint::load`]: crate::checkpoint::load
    pub async fn save_checkpoint(
        &mut self,
        dir: &Path,
        tensors: &TensorMap,
        extra: &serde_json::Value,
    ) -> Result<PathBuf> {
        let staging = crate::checkpoint::fresh_staging(dir, self.step).map_err(checkpoint_error)?;
        let absolute = std::path::absolute(&staging).map_err(|e| Error::Checkpoint {
            path: staging.display().to_string(),
            reason: e.to_string(),
        })?;
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let cmd = WriteShardsCmd {
            dir: absolute.display().to_string(),
        };
        let reply = supervisor
            .call(
                |reply| SupervisorMsg::WriteShards(cmd, reply),
                Some(timeout),
            )
            .await;
        let files = match unwrap_call(reply, "write shards", self.step, timeout) {
            Ok(Ok(files)) => files,
            Ok(Err(e)) | Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(e);
            }
        };
        sharded::finish(dir, &staging, self.step, tensors, files, extra).map_err(checkpoint_error)
    }
}
