//! Shared-memory backend (Linux): an owner publishes regions into files under `/dev/shm` and
//! readers in other processes of the same host map them read-only and copy out one-sidedly.
//! [`segment`] is the file format and its seqlock.

pub(crate) mod segment;
