//! The server on the CPU backends with the tiny random CustomVoice checkpoint, and the tiny
//! random Base checkpoint for registered voices (their audio is noise, their timing and
//! streaming are real), in this process on 127.0.0.1.

mod common;
mod fuzz;
mod http;
mod overload;
mod voices;
mod ws;
