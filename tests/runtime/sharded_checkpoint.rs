//! Sharded checkpoints (issue 30): every shard server writes its own shards, the job publishes
//! the step directory, and the checkpoint reads back whole, so a job resumes from it with another
//! number of servers, parameters and optimizer state exact; written asynchronously, it holds the
//! state of the step it was started at, whatever the job did meanwhile.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use odc::checkpoint::{self, TensorMap};
use odc::transport::local::LocalTransport;
use odc::transport::wrap::{Wrap, Wrapped};
use odc::transport::{Deadline, Dest, RegionHandle, Transport, TransportError};
use odc::{DispatchMode, Precision};

use crate::model::{self, minibatches};
use crate::{model_job, within};

/// The in-process transport, counting the bytes every read returns.
#[derive(Default)]
struct CountingReads {
    inner: LocalTransport,
    bytes: AtomicU64,
}

#[odc::async_trait]
impl Wrap for CountingReads {
    fn inner(&self) -> &dyn Transport {
        &self.inner
    }
    async fn read(
        &self,
        handle: &RegionHandle,
        range: Range<usize>,
        into: Dest<'_>,
        deadline: Deadline,
    ) -> Result<u64, TransportError> {
        let len = range.len() as u64;
        let got = self.inner.read(handle, range, into, deadline).await?;
        let size = handle.dtype.size() as u64;
        self.bytes.fetch_add(len * size, Ordering::Relaxed);
        Ok(got)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_4_servers_resumes_with_2_and_3_exactly() {
    within(180, async {
        let data = minibatches(47, 2, 10, 30);
        let counting = Arc::new(Wrapped(CountingReads::default()));
        let mut job = model_job(2, 4, DispatchMode::Static, Precision::F32, Arc::default())
            .transport(counting.clone())
            .build()
            .expect("valid job");
        for mb in &data {
            job.step_with(mb.clone()).await.expect("step succeeds");
        }
        let before = counting.0.bytes.load(Ordering::Relaxed);
        let state = job.train_state().await.expect("train state");
        let read_out = counting.0.bytes.load(Ordering::Relaxed) - before;
        assert!(state
            .optimizer
            .iter()
            .any(|o| o.steps == 2 && !o.buffers.is_empty()));
        let names: Vec<(String, usize)> = model::units()
            .iter()
            .map(|u| (u.name.clone(), u.len))
            .collect();
        let map = TensorMap::flat(&names).expect("tensor map");
        let dir = std::env::temp_dir().join(format!("odc-sharded-{}", std::process::id()));
        let extra = serde_json::json!({"data_position": 7});
        let before = counting.0.bytes.load(Ordering::Relaxed);
        let step = job
            .save_checkpoint(&dir, &map, &extra)
            .await
            .expect("sharded save");
        // Bytes through the caller: the whole state for the read-out, none for the checkpoint.
        let saved = counting.0.bytes.load(Ordering::Relaxed) - before;
        let elems: usize = state.params.iter().map(Vec::len).sum();
        eprintln!("bytes read by the caller: train_state {read_out}, save_checkpoint {saved}");
        assert!(
            read_out >= 12 * elems as u64,
            "{read_out} for {elems} parameters"
        );
        assert_eq!(
            saved, 0,
            "a sharded checkpoint reads no shard through the caller"
        );
        job.shutdown().await;
        assert_eq!(step, dir.join("step-2"));
        let mut files: Vec<String> = std::fs::read_dir(&step)
            .expect("step directory")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        assert_eq!(
            files,
            [
                "manifest.json",
                "shard-00000.safetensors",
                "shard-00001.safetensors",
                "shard-00002.safetensors",
                "shard-00003.safetensors",
                "state.json"
            ],
            "one file per server, no consolidated model file"
        );
        checkpoint::verify(&step).expect("verifies");
        assert_eq!(
            checkpoint::newest(&dir).expect("newest"),
            Some(step.clone())
        );
        let (loaded, back) = checkpoint::load(&step, &map).expect("load");
        assert_eq!(
            loaded, state,
            "the servers' files hold exactly the job's state"
        );
        assert_eq!(back, extra);

        // Resumed with 2 and 3 servers from the opened (mapped) checkpoint: each server reads
        // its own ranges, so together they read every byte of the state exactly once.
        let state_bytes: usize = loaded
            .params
            .iter()
            .zip(&loaded.optimizer)
            .map(|(p, o)| 4 * p.len() * (1 + o.buffers.len()))
            .sum();
        for servers in [2, 3] {
            let opened = checkpoint::open(&step, &map).expect("open");
            let mut resumed = model_job(
                2,
                servers,
                DispatchMode::Static,
                Precision::F32,
                Arc::default(),
            )
            .resume_from(opened.clone())
            .build()
            .expect("valid resumed job");
            let again = resumed.train_state().await.expect("train state");
            resumed.shutdown().await;
            assert_eq!(
                again, loaded,
                "{servers} servers: parameters and optimizer state exact"
            );
            assert_eq!(
                opened.bytes_read() as usize,
                state_bytes,
                "{servers} servers read the state once, each its own ranges"
            );
        }

        // Consolidated on request: one model file by the model's names, the same state.
        let whole =
            checkpoint::sharded::consolidate(&step, &map, &dir.join("whole")).expect("consolidate");
        assert!(whole.join(checkpoint::MODEL_FILE).is_file());
        assert_eq!(checkpoint::load(&whole, &map).expect("load").0, state);

        // Asynchronous: the copy is taken when the call returns, so a step right after it does
        // not change what is written; the next call waits for it and returns its directory.
        let mut job = model_job(2, 4, DispatchMode::Static, Precision::F32, Arc::default())
            .resume(loaded.clone())
            .build()
            .expect("valid job");
        let later = dir.join("later");
        let started = job
            .checkpoint_async(&later, &map, &extra)
            .await
            .expect("started");
        assert_eq!(started, None, "nothing was pending");
        let more = minibatches(48, 1, 10, 30);
        job.step_with(more[0].clone())
            .await
            .expect("a step while it is written");
        let after = job.train_state().await.expect("train state");
        let written = job
            .wait_checkpoint()
            .await
            .expect("written")
            .expect("pending");
        assert_eq!(written, later.join("step-2"));
        assert_eq!(checkpoint::load(&written, &map).expect("load").0, loaded);
        assert_ne!(after, loaded, "the step moved the job on");
        assert_eq!(job.wait_checkpoint().await.expect("none"), None);
        job.shutdown().await;

        // A flipped byte in one server's file: named, never loaded.
        let shard = step.join("shard-00002.safetensors");
        let mut bytes = std::fs::read(&shard).expect("shard file");
        let last = bytes.len() - 3;
        bytes[last] ^= 1;
        std::fs::write(&shard, bytes).expect("damage");
        let e = checkpoint::load(&step, &map)
            .expect_err("damaged")
            .to_string();
        assert!(
            e.contains("shard-00002.safetensors") && e.contains("checksum"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    })
    .await;
}
