//! What several test binaries share.

pub mod alloc;
