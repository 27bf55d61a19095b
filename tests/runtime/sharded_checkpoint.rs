//! Sharded checkpoints (issue 30): every shard server writes its own shards, the job publishes
//! the step directory, and the checkpoint reads back whole, so a job resumes from it with another
//! number of servers, parameters and optimizer state exact; written asynchronously, it holds the
//! state of the step it was started at, whatever the job did meanwhile.

use std::sync::Arc;

use odc::checkpoint::{self, TensorMap};
use odc::{DispatchMode, Precision};

use crate::model::{self, minibatches};
use crate::{model_job, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_4_servers_resumes_with_2_and_3_exactly() {
    within(180, async {
        let data = minibatches(47, 2, 10, 30);
        let mut job = model_job(2, 4, DispatchMode::Static, Precision::F32, Arc::default())
            .build()
            .expect("valid job");
        for mb in &data {
            job.step_with(mb.clone()).await.expect("step succeeds");
        }
        let state = job.train_state().await.expect("train state");
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
        let step = job
            .save_checkpoint(&dir, &map, &extra)
            .await
            .expect("sharded save");
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

        for servers in [2, 3] {
            let mut resumed = model_job(
                2,
                servers,
                DispatchMode::Static,
                Precision::F32,
                Arc::default(),
            )
            .resume(loaded.clone())
            .build()
            .expect("valid resumed job");
            let again = resumed.train_state().await.expect("train state");
            resumed.shutdown().await;
            assert_eq!(
                again, loaded,
                "{servers} servers: parameters and optimizer state exact"
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
