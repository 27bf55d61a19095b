//! Where minibatches come from.

use odc_actors::batch::SampleMeta;
use odc_actors::Result;

/// Yields the samples of each step's minibatch. The compute resolves [`SampleMeta::index`] in the
/// user's dataset.
pub trait DataSource: Send + 'static {
    fn minibatch(&mut self, step: u64) -> Result<Vec<SampleMeta>>;
}

impl<F> DataSource for F
where
    F: FnMut(u64) -> Result<Vec<SampleMeta>> + Send + 'static,
{
    fn minibatch(&mut self, step: u64) -> Result<Vec<SampleMeta>> {
        self(step)
    }
}
