//! Measurements the benchmark reports next to the kernel's own timing.

use std::sync::Arc;

use anyhow::Result;
use cudarc::driver::CudaContext;

/// Device-to-device copy bandwidth in GB/s over `bytes`-sized buffers, counting bytes read and
/// written (the convention of the ~3.0 TB/s H100 figure the floor in megakernel-notes.md uses).
pub fn device_copy_gbs(ctx: &Arc<CudaContext>, bytes: usize) -> Result<f64> {
    let stream = ctx.default_stream();
    let src = stream.alloc_zeros::<u8>(bytes)?;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    stream.memcpy_dtod(&src, &mut dst)?;
    stream.synchronize()?;
    let reps = 10;
    let started = std::time::Instant::now();
    for _ in 0..reps {
        stream.memcpy_dtod(&src, &mut dst)?;
    }
    stream.synchronize()?;
    let seconds = started.elapsed().as_secs_f64();
    Ok((2 * reps * bytes) as f64 / seconds / 1e9)
}
