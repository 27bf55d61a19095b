//! How the actors of a job find each other across processes: the names of their `ractor::pg`
//! groups and a bounded wait for a group's first member. The host joins its group, the session
//! and the supervisor's placement look members up; every name is prefixed by the job's, so two
//! jobs on one cluster never see each other's actors.

use std::time::Duration;

use ractor::ActorCell;

/// The `ractor::pg` group of rank `rank`'s host in job `job`.
pub fn host_group(job: &str, rank: u32) -> String {
    format!("odc.{job}.host.{rank}")
}

/// The `ractor::pg` group of job `job`'s supervisor.
pub fn supervisor_group(job: &str) -> String {
    format!("odc.{job}.supervisor")
}

/// The first member of `group`, polled until `within` passes (`None` then: bounded, I6).
pub async fn wait_member(group: &str, within: Duration) -> Option<ActorCell> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(cell) = ractor::pg::get_members(&group.to_string())
            .into_iter()
            .next()
        {
            return Some(cell);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
