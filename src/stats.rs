//! Counters of a session.

/// Counters of a session (this rank).
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct SessionStats {
    /// Slices pushed to servers.
    pub pushes: u64,
    /// Factor blocks sent.
    pub factor_sends: u64,
    /// Scheme decisions this rank took in the run (adaptive schemes), and
    /// the switches they made.
    #[serde(default)]
    pub decisions: u64,
    #[serde(default)]
    pub switches: u64,
    /// Slices this rank's server accumulated.
    pub accumulated: u64,
    /// Chunk applies.
    pub applies: u64,
    /// Chunk broadcasts.
    pub broadcasts: u64,
    /// Bytes this rank's transport received directly into registered memory.
    pub rx_direct_bytes: u64,
    /// Bytes this rank's transport copied out to the application (messages).
    pub rx_copied_bytes: u64,
    /// Payload bytes this rank's transport sent (writes and messages): its
    /// NIC's transmit side. With local learners, one rank per node sends for all.
    #[serde(default)]
    pub tx_payload_bytes: u64,
    /// Send operations this rank's transport handed to the kernel or the NIC
    /// (see `tidewire_transport::Counters::tx_sends`), set-up included.
    #[serde(default)]
    pub tx_sends: u64,
    /// Contribution bytes this rank's server summed on the CPU.
    pub cpu_aggregated_bytes: u64,
    /// Contribution bytes this rank's server summed on the GPU (Nexus).
    pub gpu_aggregated_bytes: u64,
    /// Chunks the aggregation scheduler placed on the CPU, and on the GPU
    /// (each chunk's sums run where it was placed).
    #[serde(default)]
    pub cpu_aggregation_chunks: u64,
    #[serde(default)]
    pub gpu_aggregation_chunks: u64,
    /// Most transmits outstanding to one peer at once (never above the transport's bound).
    pub max_outstanding: u64,
    /// Largest message sent, bytes (never above the transport's cap).
    pub max_message_bytes: u64,
    /// Transmits the transport refused for now (`WouldBlock`) and that were retried.
    pub would_block: u64,
    /// Hand-ins followed by a post on the wire, and the median and 99th
    /// percentile of the time from the caller's `grad_ready`/`sf_ready` to
    /// that first post, over the last 4096 such hand-ins, ns.
    pub hand_in_posts: u64,
    /// See `hand_in_posts`.
    pub hand_in_to_post_p50_ns: u64,
    /// See `hand_in_posts`.
    pub hand_in_to_post_p99_ns: u64,
    /// Factor bytes (U and V of every worker) the SF reconstructions read in
    /// place, in the buffers the transport received them in.
    #[serde(default)]
    pub factor_bytes_in_place: u64,
    /// Factor bytes the SF reconstructions decoded into scratch first: U or V
    /// of a block split over several messages (over the message cap), or a
    /// misaligned buffer. 0 when every U and V fits a message.
    #[serde(default)]
    pub factor_bytes_decoded: u64,
    /// FLOPs of the gradients this rank rebuilt from sufficient factors
    /// (2·K·M·N each: SFB's reconstructions, and a worker's own dense
    /// gradient formed from its factors), and the executor's time on them.
    #[serde(default)]
    pub gemm_flops: u64,
    /// See `gemm_flops`, ns.
    #[serde(default)]
    pub gemm_ns: u64,
    /// Input bytes this rank's server executor folded into accumulators, and
    /// its time on them (on the CPU or the GPU, wherever they were placed).
    #[serde(default)]
    pub sum_bytes: u64,
    /// See `sum_bytes`, ns.
    #[serde(default)]
    pub sum_ns: u64,
    /// Parameters this rank updated (its server's chunks, its SFB layers),
    /// and the executors' time on them.
    #[serde(default)]
    pub apply_params: u64,
    /// See `apply_params`, ns.
    #[serde(default)]
    pub apply_ns: u64,
    /// Slices of layers with the sparse hint that this worker pushed as
    /// index/value pairs (Nexus's sparse push), over all such layers.
    #[serde(default)]
    pub sparse_pushes: u64,
    /// Slices of layers with the sparse hint pushed dense (denser than the
    /// measured threshold).
    #[serde(default)]
    pub sparse_dense_pushes: u64,
    /// Nonzero elements of the slices pushed as pairs.
    #[serde(default)]
    pub sparse_nonzeros: u64,
    /// Elements of the slices pushed as pairs: `sparse_nonzeros /
    /// sparse_elements` is their density.
    #[serde(default)]
    pub sparse_elements: u64,
    /// Bytes written as pairs (8 per pair and 8 per slice).
    #[serde(default)]
    pub sparse_bytes: u64,
    /// Bytes of sparse-hinted layers written dense.
    #[serde(default)]
    pub sparse_dense_bytes: u64,
    /// Late contributions this rank's server dropped (quorum and timeout triggers).
    #[serde(default)]
    pub dropped: u64,
    /// Late contributions folded into the next round (the async trigger).
    #[serde(default)]
    pub late_folded: u64,
    /// Chunk rounds applied with fewer than every worker's contribution.
    #[serde(default)]
    pub partial_applies: u64,
}
