//! The sans-IO core of Tidewire.
//!
//! This crate will hold the information book, Poseidon's cost model, P3's
//! slicing and priority + credit scheduling, the KV-store shard state machine
//! and BSP/SSP bookkeeping (the engine issue). It takes events in and hands
//! commands out, with time and randomness passed in, so a deterministic
//! simulator can drive it as well as the real driver.
//!
//! Its dependency tree must never contain an I/O crate (io-uring, sideway,
//! cudarc, or the transport and gpu crates); `ci/test.sh` checks this.
