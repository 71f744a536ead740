//! The server on the CPU backends with the tiny random CustomVoice checkpoint (its audio is
//! noise, its timing and streaming are real), in this process on 127.0.0.1.

mod common;
mod fuzz;
mod http;
mod overload;
mod ws;
