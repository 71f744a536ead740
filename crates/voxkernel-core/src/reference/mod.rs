//! The CPU reference backend (candle, f32): the executable specification the CUDA backend is
//! judged against.
