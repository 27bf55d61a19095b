//! A job's sharded checkpoint ([`Job::save_checkpoint`]): written by the shard servers, each from
//! its own memory, and published by the caller ([`crate::checkpoint::sharded`]).

use std::path::{Path, PathBuf};

use odc_actors::messages::WriteShardsCmd;
use odc_actors::supervisor::SupervisorMsg;
use odc_actors::{Error, Result};

use crate::checkpoint::step_dir;

use crate::checkpoint::sharded::Publication;
use crate::checkpoint::{CheckpointError, TensorMap};

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
    /// Writes a checkpoint of the job's state at its current step into `dir/step-<N>`, sharded,
    /// and returns once it is on disk: [`Job::checkpoint_async`] and [`Job::wait_checkpoint`].
    pub async fn save_checkpoint(
        &mut self,
        dir: &Path,
        tensors: &TensorMap,
        extra: &serde_json::Value,
    ) -> Result<PathBuf> {
        self.checkpoint_async(dir, tensors, extra).await?;
        self.wait_checkpoint()
            .await?
            .ok_or_else(|| Error::Internal("a checkpoint started but none is pending".into()))
    }

    /// Starts a checkpoint of the job's state at its current step into `dir/step-<N>`, sharded,
    /// written while training goes on (PyTorch DCP's `async_save`):
    ///
    /// 1. the previous checkpoint, if one is still being written, is waited for first (its
    ///    error is this call's; its directory is returned);
    /// 2. every shard server copies its shards at the current version (fp32 masters and optimizer
    ///    state, from host or device memory: one copy of its shards at most) and replies, so the
    ///    next step cannot change what is written;
    /// 3. in the background each server writes its copy as one synced `shard-<server>.safetensors`
    ///    in a staging directory this process made, and this process then adds `state.json`
    ///    (with `extra`) and the manifest — the servers' own sizes and CRC32Cs — and renames it
    ///    into place ([`crate::checkpoint::sharded`]): no byte of another server's shards passes
    ///    through it.
    ///
    /// A failed write is reported by the next call, by [`Job::wait_checkpoint`], or (logged) by
    /// [`Job::shutdown`]; never silent. `tensors` names the model's tensors (checked on load).
    /// `dir` is one path: on a shared filesystem every server writes into the one directory; with
    /// per-host directories (a local disk at that path on each host) each host's servers write
    /// into their own, one server of each other host publishes its part first (its shard files,
    /// `state.json` with every server's ranges, a manifest of what it holds) and this process's
    /// `step-<N>` appears last ([`crate::checkpoint::step_dir`]). Resuming
    /// ([`checkpoint::open`](crate::checkpoint::open), `JobBuilder::resume_from`) reads each
    /// server's ranges where they are: with any number of servers from a shared directory, with
    /// the same servers per host from per-host ones. With
    /// [`JobBuilder::keep_last_checkpoints`](crate::JobBuilder::keep_last_checkpoints) every host
    /// then prunes its older steps. Call it between steps.
    pub async fn checkpoint_async(
        &mut self,
        dir: &Path,
        tensors: &TensorMap,
        extra: &serde_json::Value,
    ) -> Result<Option<PathBuf>> {
        let previous = self.wait_checkpoint().await?;
        let staging = crate::checkpoint::fresh_staging(dir, self.step).map_err(checkpoint_error)?;
        let absolute = std::path::absolute(&staging).map_err(|e| Error::Checkpoint {
            path: staging.display().to_string(),
            reason: e.to_string(),
        })?;
        // The lead's claim: a server whose host shares this directory finds it (see
        // `odc_checkpoint::step_dir`).
        let lead_id = format!(
            "lead-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        );
        step_dir::claim(&absolute, &lead_id)?;
        let supervisor = self.supervisor().await?;
        let timeout = self.parameters_timeout;
        let step = self.step;
        let cmd = WriteShardsCmd {
            dir: absolute.display().to_string(),
        };
        let reply = supervisor
            .call(
                |reply| SupervisorMsg::WriteShards(cmd, reply),
                Some(timeout),
            )
            .await;
        if let Err(e) = unwrap_call(reply, "write shards", step, timeout).and_then(|r| r) {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        let (dir, tensors, extra) = (dir.to_path_buf(), tensors.clone(), extra.clone());
        let keep_last = self.keep_last;
        self.checkpoint = Some(tokio::spawn(async move {
            // The servers' writes may take longer than a read-out: the supervisor bounds each.
            let wait = timeout.max(std::time::Duration::from_secs(3600));
            let reply = supervisor
                .call(SupervisorMsg::ShardsWritten, Some(wait))
                .await;
            let published = async {
                let written = unwrap_call(reply, "shards written", step, wait).and_then(|r| r)?;
                let publication =
                    Publication::new(&dir, &staging, step, &tensors, written, &lead_id, &extra)
                        .map_err(checkpoint_error)?;
                // Other hosts' directories first (per-host checkpoint directories): the lead's
                // step directory appears last, once every host holds its part.
                let hosts = publication.hosts(keep_last).map_err(checkpoint_error)?;
                if !hosts.is_empty() {
                    let reply = supervisor
                        .call(|r| SupervisorMsg::PublishShards(hosts, r), Some(timeout))
                        .await;
                    unwrap_call(reply, "publish shards", step, timeout).and_then(|r| r)?;
                }
                let dir = dir.clone();
                tokio::task::spawn_blocking(move || {
                    let step_dir = publication.finish()?;
                    crate::checkpoint::retain(&dir, keep_last)?;
                    Ok(step_dir)
                })
                .await
                .map_err(|e| Error::Internal(format!("the checkpoint's publisher: {e}")))?
                .map_err(checkpoint_error)
            };
            let result = published.await;
            if result.is_err() {
                let _ = std::fs::remove_dir_all(&staging);
            }
            result
        }));
        Ok(previous)
    }

    /// Waits for the checkpoint [`Job::checkpoint_async`] started, if one is pending: its
    /// directory once it is published, or why it was not.
    pub async fn wait_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        match self.checkpoint.take() {
            None => Ok(None),
            Some(task) => task
                .await
                .map_err(|e| Error::Internal(format!("the checkpoint task: {e}")))?
                .map(Some),
        }
    }
}
