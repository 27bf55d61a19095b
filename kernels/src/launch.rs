//! One way to run odc's kernels, whatever runs them: a [`Launcher`] compiles a [`Source`] into a
//! module, holds buffers of bytes, and launches a module's function over `n` work items with
//! [`Arg`]s (the grid-stride contract of the crate's docs). Two launchers exist: this CPU's
//! emulation ([`crate::emulate::Emulator`], feature `emulate`) and a CUDA device
//! (odc-transport's `cuda::Device`, whose modules NVRTC compiles through `crate::nvrtc`). Every
//! caller is written once against it: the kernels' own checks (`tests/cases/`), the shard
//! servers' optimizer step and the transport's accumulate; the model's fused ops launch on
//! candle's tensors with the same [`Arg`]s.
//!
//! Guarantees a launcher keeps:
//! - [`Launcher::launch`] returns once the kernel finished (or failed): its outputs can be read.
//! - A function the module does not have, a source that does not compile, or a buffer the
//!   launcher cannot address is an error naming it, never a panic.

use crate::Source;

/// One parameter of a launch: a buffer (its address), or a scalar of the kernel parameter's type
/// (`unsigned long long`, `int`, `float`, `double`).
#[derive(Debug)]
pub enum Arg<'a, B> {
    Buffer(&'a B),
    U64(u64),
    I32(i32),
    F32(f32),
    F64(f64),
}

impl<B> Clone for Arg<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Arg<'_, B> {}

impl<'a, B> Arg<'a, B> {
    /// A pointer parameter: `buffer`'s address.
    pub fn buffer(buffer: &'a B) -> Self {
        Arg::Buffer(buffer)
    }

    /// An `unsigned long long` parameter.
    pub fn u64(value: u64) -> Self {
        Arg::U64(value)
    }

    /// An `int` parameter.
    pub fn i32(value: i32) -> Self {
        Arg::I32(value)
    }

    /// A `float` parameter.
    pub fn f32(value: f32) -> Self {
        Arg::F32(value)
    }

    /// A `double` parameter.
    pub fn f64(value: f64) -> Self {
        Arg::F64(value)
    }
}

/// Where kernels run (see the [module docs](self)).
pub trait Launcher {
    /// Memory a kernel reads and writes.
    type Buffer;
    /// A source compiled and loaded.
    type Module;
    /// Why something could not be done; its text names what.
    type Error: std::fmt::Display;

    /// `source` compiled and loaded (a launcher may cache modules by the source's name).
    fn module(&self, source: &Source) -> Result<Self::Module, Self::Error>;

    /// A buffer holding `bytes`.
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buffer, Self::Error>;

    /// `buffer`'s bytes now.
    fn download(&self, buffer: &Self::Buffer) -> Result<Vec<u8>, Self::Error>;

    /// How many bytes `buffer` holds.
    fn bytes(&self, buffer: &Self::Buffer) -> usize;

    /// The blocks a launch of `module` over `n` work items uses (at least 1): a kernel that
    /// writes one partial result per block needs room for this many (`usize::MAX`: the most any
    /// launch uses).
    fn blocks(&self, module: &Self::Module, n: usize) -> u32;

    /// Runs `function` of `module` over `n` work items with `args`, and waits for it. `n == 0`
    /// runs nothing.
    ///
    /// # Safety
    /// `args` are `function`'s parameters in order and of their types, each buffer holding every
    /// element the kernel indexes for `n`.
    unsafe fn launch(
        &self,
        module: &Self::Module,
        function: &str,
        n: usize,
        args: &[Arg<'_, Self::Buffer>],
    ) -> Result<(), Self::Error>;
}
