//! Every way a peer can break the protocol, one variant per check
//! ([`EngineError::Protocol`](super::EngineError::Protocol) names the rank).
//!
//! A few checks guard the driver's side of the contract (a completion of a
//! transmit or job the Node never asked for): those name this rank itself.

use crate::book::Scheme;
use crate::node::LocalRegion;
use crate::wire::{Kind, WireError};

/// What a peer (or, for a completion nobody asked for, the driver) did wrong.
/// The text is the one the check has always printed; tests and users grep it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    // Connection and hello.
    /// The transport reported a second connection from the peer.
    #[error("connected twice")]
    ConnectedTwice,
    /// The peer's hello speaks another protocol version.
    #[error("it speaks protocol version {theirs}, this rank {ours}")]
    HelloVersion { theirs: u16, ours: u8 },
    /// The peer's hello names another rank than the connection's.
    #[error("its hello names rank {named}")]
    HelloRank { named: u32 },
    /// The peer's hello has no key for a region this rank writes into
    /// (`"parameter"`, `"shard"` or `"landing"`).
    #[error("it announced no {region} region")]
    HelloWithoutRegion { region: &'static str },
    /// The peer's transport limits are below what the protocol needs.
    #[error(
        "its transport takes messages of {max_message} bytes and writes of {max_write} (the protocol needs at least {} and 4)",
        crate::wire::MAX_CONTROL
    )]
    HelloLimits { max_message: u64, max_write: u64 },
    /// The peer's hello carries another number of configuration fields.
    #[error("{got} configuration fields, expected {want}")]
    FieldCount { got: usize, want: usize },
    /// A second hello on one connection.
    #[error("a second hello")]
    SecondHello,
    /// The driver says the peer's regions are known before its hello arrived.
    #[error("regions known before its hello")]
    RegionsBeforeHello,
    /// A write to the peer needs a region its hello did not announce.
    #[error("it announced no {region:?} region")]
    RegionNotAnnounced { region: LocalRegion },
    /// An event names a rank that is not a peer of this one.
    #[error("an event names rank {peer}, which is not a peer of rank {me}")]
    NotAPeer { peer: u32, me: u32 },

    // Messages.
    /// A message that does not decode.
    #[error("{0}")]
    Wire(#[source] WireError),
    /// A message other than the hello before the hello.
    #[error("a {kind:?} message before its hello")]
    BeforeHello { kind: Kind },
    /// A control message that arrived without its bytes.
    #[error("a {kind:?} message without bytes")]
    MessageWithoutBytes { kind: Kind },
    /// `finished` said twice.
    #[error("finished twice")]
    FinishedTwice,
    /// Goodbye said twice.
    #[error("said goodbye twice")]
    ByeTwice,
    /// Credit sent to a rank without a worker.
    #[error("credit sent to a rank that is not a worker")]
    CreditToNonWorker,
    /// A notification (kvstore) sent to a rank without a worker.
    #[error("a notification sent to a rank that is not a worker")]
    NotifyToNonWorker,
    /// A pull (kvstore) sent to a rank without a server.
    #[error("a pull sent to a rank that is not a server")]
    PullToNonServer,

    // Writes that landed.
    /// A gradient push to a rank without a server.
    #[error("a push to a rank that is not a server")]
    PushToNonServer,
    /// A gradient push from a rank that is not a worker.
    #[error("a push from a rank that is not a worker")]
    PushFromNonWorker,
    /// A push whose immediate names no slice of the book.
    #[error("a push of unknown slice {slice}")]
    PushUnknownSlice { slice: u32 },
    /// A dense push outside the sender's landing slots, or of the wrong length.
    #[error("a push of slice {slice} ({bytes} bytes) at offset {offset}+{len}, outside the sender's landing slots")]
    PushOutsideSlots {
        slice: u32,
        bytes: usize,
        offset: u64,
        len: u64,
    },
    /// A sparse push to a dense layer, outside the sender's landing slots, or
    /// not `8 + 8n` bytes with `n` within the slice's pair limit.
    #[error(
        "a sparse push of slice {slice} at offset {offset}+{len}: not a sparse layer, outside the sender's landing slots, or not 8 + 8n bytes with n at most {pairs_max}"
    )]
    SparsePushMalformed {
        slice: u32,
        offset: u64,
        len: u64,
        pairs_max: usize,
    },
    /// A sparse push into a landing slot already holding one.
    #[error("landing slot {slot} written twice")]
    SlotWrittenTwice { slot: u32 },
    /// Initial values written to a rank without a server.
    #[error("seeding a rank that is not a server")]
    SeedToNonServer,
    /// Initial values of a chunk the book does not have.
    #[error("seeding unknown chunk {chunk}")]
    SeedUnknownChunk { chunk: u32 },
    /// Initial values outside their chunk, or of a chunk this rank does not hold.
    #[error("seeding chunk {chunk} at {offset}+{len}, outside it")]
    SeedOutsideChunk { chunk: u32, offset: u64, len: u64 },
    /// Parameters written to a rank without a worker.
    #[error("parameters for a rank that is not a worker")]
    ParamsToNonWorker,
    /// Parameters of a chunk the book does not have.
    #[error("parameters of unknown chunk {chunk}")]
    ParamsUnknownChunk { chunk: u32 },
    /// Parameters outside their chunk, or from a rank that does not hold it.
    #[error("parameters of chunk {chunk} at {offset}+{len}, outside it")]
    ParamsOutsideChunk { chunk: u32, offset: u64, len: u64 },
    /// A write into a region peers never write.
    #[error("a write into the {region:?} region")]
    WriteIntoRegion { region: LocalRegion },

    // Sufficient factors.
    /// Factors from a rank that is not a worker.
    #[error("factors from a rank that is not a worker")]
    FactorsFromNonWorker,
    /// Factors sent to a rank without a worker (SFB).
    #[error("factors sent to a rank that is not a worker")]
    FactorsToNonWorker,
    /// A factor block of a layer the table does not have.
    #[error("unknown layer {layer} (the table has {layers} layers)")]
    FactorsUnknownLayer { layer: u32, layers: u32 },
    /// A factor block for a layer that does not take factors this iteration,
    /// or of the wrong size.
    #[error(
        "a factor block of {total} bytes for layer {layer} ({name}), which syncs by {scheme:?} ({want} bytes expected)"
    )]
    FactorBlockMismatch {
        total: u64,
        layer: u32,
        name: String,
        scheme: Scheme,
        want: u64,
    },
    /// Adam factors sent to a rank that does not hold the layer.
    #[error("adam factors of layer {layer} sent to rank {to}, but rank {holder} holds the layer")]
    AdamFactorsMisrouted { layer: u32, to: u32, holder: u32 },
    /// Adam factors sent to a rank without a server.
    #[error("adam factors of layer {layer} sent to rank {to}, which is not a server")]
    AdamFactorsToNonServer { layer: u32, to: u32 },
    /// A factor block began while the peer's previous one was incomplete.
    #[error("a block of {block} began while the one of {open}, iteration {open_iter}, was incomplete")]
    FactorBlockOverlap {
        block: String,
        open: String,
        open_iter: u64,
    },
    /// Factor data with no factor block begun.
    #[error("factor data without a factor block")]
    FactorDataWithoutBlock,
    /// An empty factor fragment, or one past the block's end.
    #[error("a factor fragment of {bytes} bytes at {at} of a {total}-byte block")]
    FactorFragmentOverrun { bytes: usize, at: usize, total: usize },
    /// A worker's second factor block for one layer and iteration.
    #[error("a second factor block for layer {layer} iteration {iter}")]
    SecondFactorBlock { layer: u32, iter: u64 },
    /// The server summed factors before every worker's block was stored
    /// (this rank's own fault).
    #[error("the server summed layer {layer} iteration {iter} without every worker's factors")]
    SumWithoutFactors { layer: u32, iter: u64 },
    /// Factors at a server before its shard was seeded.
    #[error("factors before the shard was initialized")]
    FactorsBeforeInit,
    /// Factors at a server for a layer that does not sync by Adam.
    #[error("factors for layer {layer}, which does not sync by adam")]
    FactorsNotAdam { layer: u32 },
    /// SFB factors at a worker for an iteration the layer does not sync by SFB.
    #[error("factors of layer {layer} for iteration {iter}, which does not sync by sfb then")]
    FactorsNotSfb { layer: u32, iter: u64 },
    /// A scheme decision that is not the next point's, or bits past the contested layers.
    #[error("a scheme decision for iteration {at}: {why}")]
    BadDecision { at: u64, why: String },
    /// A scheme decision from a rank other than worker index 0, or one that came to worker 0.
    #[error("a scheme decision from a rank that does not decide")]
    DecisionFromNonDecider,
    /// A write of a chunk's values into a seeded shard that no switch back
    /// to the PS asked for, or not from worker index 0.
    #[error("values of chunk {chunk} written into the shard again, where no switch back to the ps asked for them (next round {round})")]
    ReseedUnexpected { chunk: u32, round: u64 },
    /// A chunk's momentum that no switch asks for: not from the rank that
    /// sends it (worker index 0 to the servers where a layer comes back to
    /// the PS; the chunk's server to the workers where it leaves the PS),
    /// not at such a switch, or with momentum that does not move.
    #[error("momentum of chunk {chunk} for iteration {iter}, where no scheme switch asks for it from this sender")]
    MomentumUnexpected { chunk: u32, iter: u64 },
    /// A chunk's momentum of another size than the chunk's.
    #[error("momentum of chunk {chunk} of {total} bytes, where the chunk holds {want}")]
    MomentumSize { chunk: u32, total: u64, want: u64 },
    /// A chunk's momentum twice for one switch.
    #[error("momentum of chunk {chunk} for iteration {iter} twice")]
    MomentumTwice { chunk: u32, iter: u64 },
    /// Adam factors for another iteration than the layer's next.
    #[error("factors of layer {layer} for iteration {iter}, while the layer's next iteration is {next}")]
    FactorsOutOfOrder { layer: u32, iter: u64, next: u64 },
    /// SFB factors of an iteration the worker already applied.
    #[error("factors of layer {layer} for iteration {iter}, already applied")]
    FactorsAlreadyApplied { layer: u32, iter: u64 },
    /// More factor messages for one layer and iteration than there are workers.
    #[error("too many factor messages for layer {layer} iteration {iter}")]
    TooManyFactors { layer: u32, iter: u64 },
    /// The driver applied a reconstruction the worker did not ask for.
    #[error("apply of layer {layer} iteration {iter} was not asked for")]
    ApplyNotAsked { layer: u32, iter: u64 },

    // The server's shard.
    /// Initial values of a chunk sent twice.
    #[error("initial values for chunk {chunk} sent twice")]
    InitTwice { chunk: u32 },
    /// A chunk outside this server's shard.
    #[error("chunk {chunk} is not in the shard of rank {server}")]
    ChunkNotInShard { chunk: u32, server: u32 },
    /// A slice outside this server's shard.
    #[error("slice {slice} is not in the shard of rank {server}")]
    SliceNotInShard { slice: u32, server: u32 },
    /// A gradient push before the shard was seeded.
    #[error("a gradient push before the shard was initialized")]
    PushBeforeInit,
    /// A landing slot number past the slots.
    #[error("landing slot {slot} out of range (landing slots: {slots})")]
    SlotOutOfRange { slot: u32, slots: u32 },
    /// A slice for an iteration whose predecessor is not applied yet.
    #[error("slice {slice} for iteration {iter} while iteration {applied} is not applied")]
    SliceTooEarly { slice: u32, iter: u64, applied: u64 },
    /// A worker holds more landing slots than it was granted.
    #[error("more pushes in flight than credits granted")]
    CreditsExceeded,
    /// A parked slot of a rank that is not a worker.
    #[error("a parked slot of a rank that is not a worker")]
    ParkedFromNonWorker,
    /// A parked (spare) slot freed twice, or out of range.
    #[error("parked slot {slot} freed twice")]
    ParkedFreedTwice { slot: u32 },
    /// A pull from a rank that is not a worker.
    #[error("a pull from a rank that is not a worker")]
    PullFromNonWorker,
    /// A pull in a job that broadcasts.
    #[error("a pull, but this job broadcasts (it is not kvstore)")]
    PullNotKvstore,
    /// A pull of a version the server did not notify.
    #[error("a pull of chunk {chunk} at version {version}, which was not notified (the chunk is at {at})")]
    PullNotNotified { chunk: u32, version: u64, at: u64 },
    /// A broadcast completion for a chunk not being broadcast.
    #[error("broadcast completion for chunk {chunk} that was not sent")]
    BroadcastNotSent { chunk: u32 },
    /// A worker that was not lost rejoined.
    #[error("a worker that was not lost came back")]
    RejoinNotLost,
    /// A colocated worker's landing slot returned that was not taken (this
    /// rank's own fault).
    #[error("local slot {slot} was not taken")]
    LocalSlotNotTaken { slot: u32 },

    // The worker.
    /// A push completion for a slice the book does not have.
    #[error("push completion for unknown slice {slice}")]
    PushDoneUnknownSlice { slice: u32 },
    /// A push completion for a slice not in flight.
    #[error("push completion for slice {slice} that is not in flight")]
    PushDoneNotInFlight { slice: u32 },
    /// A factor send completion for a layer not in flight.
    #[error("factor send completion for layer {layer} that is not in flight")]
    FactorsSentNotInFlight { layer: u32 },
    /// Credit from a rank that is not one of the cluster's servers.
    #[error("credit from a rank that is not a server")]
    CreditFromOutside,
    /// Credit for a slot that was not lent (or past the slots).
    #[error("credit for slot {slot} that was not lent")]
    CreditNotLent { slot: u32 },
    /// A notification of a chunk the book does not have.
    #[error("a notification for unknown chunk {chunk}")]
    NotifyUnknownChunk { chunk: u32 },
    /// A notification in a job that broadcasts.
    #[error("a notification, but this job broadcasts (it is not kvstore)")]
    NotifyNotKvstore,
    /// A notification from another rank than the chunk's server, or of
    /// another version than the one the layer waits for (`None`: the layer is
    /// not handed in).
    #[error(
        "a notification of chunk {chunk} (layer {layer}) at version {version}, while the layer {} (chunk owned by rank {owner})",
        waiting(waits_for)
    )]
    NotifyOutOfStep {
        chunk: u32,
        layer: u32,
        version: u64,
        waits_for: Option<u64>,
        owner: u32,
    },
    /// Parameters written for a chunk the book does not have.
    #[error("parameters for unknown chunk {chunk}")]
    ParamsForUnknownChunk { chunk: u32 },
    /// Parameters written without a pull (kvstore).
    #[error("parameters of chunk {chunk} arrived without a pull (kvstore)")]
    ParamsWithoutPull { chunk: u32 },
    /// Parameters written while the caller holds the layer (BSP).
    #[error("parameters of chunk {chunk} arrived while its layer {layer} is not handed in")]
    ParamsWhileHeld { chunk: u32, layer: u32 },
    /// Under BSP, a chunk's values broadcast more often than the iterations
    /// its layer was handed in for (its initial values count once).
    #[error("chunk {chunk} broadcast {updates} times, more than its layer was handed in for under BSP")]
    ParamsTwice { chunk: u32, updates: u64 },

    // The driver's completions (this rank's own fault).
    /// A completion of a job the Node never started.
    #[error("completion of unknown job {id}")]
    UnknownJob { id: u64 },
    /// A completion of a transmit the Node never posted.
    #[error("completion of unknown transmit {token}")]
    UnknownTransmit { token: u64 },
    /// A failure of a transmit the Node never posted.
    #[error("failure of unknown transmit {token}: {reason}")]
    UnknownTransmitFailed { token: u64, reason: String },
}

fn waiting(waits_for: &Option<u64>) -> String {
    match waits_for {
        Some(v) => format!("waits for version {v}"),
        None => "is not handed in".into(),
    }
}

/// The messages are the ones the checks always printed (the tests moved here
/// from `error.rs`, which imports nothing the violations import).
#[cfg(test)]
mod tests {
    use crate::book::Scheme;
    use crate::error::{EngineError, JobCause, JobFailure, ProtocolViolation};
    use crate::wire::WireError;
    use std::error::Error as _;

    #[test]
    fn violations_say_what_the_checks_always_said() {
        let cases = [
            (
                EngineError::protocol(2, ProtocolViolation::SlotWrittenTwice { slot: 3 }),
                "protocol violation by rank 2: landing slot 3 written twice",
            ),
            (
                EngineError::protocol(
                    0,
                    ProtocolViolation::NotifyOutOfStep {
                        chunk: 4,
                        layer: 1,
                        version: 7,
                        waits_for: Some(5),
                        owner: 3,
                    },
                ),
                "protocol violation by rank 0: a notification of chunk 4 (layer 1) at version 7, while the layer waits for version 5 (chunk owned by rank 3)",
            ),
            (
                EngineError::protocol(
                    0,
                    ProtocolViolation::NotifyOutOfStep {
                        chunk: 4,
                        layer: 1,
                        version: 7,
                        waits_for: None,
                        owner: 3,
                    },
                ),
                "protocol violation by rank 0: a notification of chunk 4 (layer 1) at version 7, while the layer is not handed in (chunk owned by rank 3)",
            ),
            (
                EngineError::protocol(
                    1,
                    ProtocolViolation::HelloLimits {
                        max_message: 100,
                        max_write: 2,
                    },
                ),
                "protocol violation by rank 1: its transport takes messages of 100 bytes and writes of 2 (the protocol needs at least 256 and 4)",
            ),
            (
                EngineError::protocol(
                    1,
                    ProtocolViolation::FactorBlockMismatch {
                        total: 8,
                        layer: 2,
                        name: "fc7".into(),
                        scheme: Scheme::Ps,
                        want: 16,
                    },
                ),
                "protocol violation by rank 1: a factor block of 8 bytes for layer 2 (fc7), which syncs by Ps (16 bytes expected)",
            ),
            (
                EngineError::Job(JobFailure::CaptureSize {
                    layer: 3,
                    got: 10,
                    want: 12,
                }),
                "compute job failed: captured 10 bytes of factors of layer 3, expected 12",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn a_violation_is_the_source_and_keeps_the_wire_error() {
        let e = EngineError::protocol(1, ProtocolViolation::Wire(WireError::UnknownKind(99)));
        assert_eq!(e.to_string(), "protocol violation by rank 1: unknown message kind 99");
        let v = e.source().expect("the violation");
        assert_eq!(
            v.downcast_ref::<ProtocolViolation>(),
            Some(&ProtocolViolation::Wire(WireError::UnknownKind(99)))
        );
        assert_eq!(
            v.source().and_then(|w| w.downcast_ref::<WireError>()),
            Some(&WireError::UnknownKind(99))
        );
    }

    #[test]
    fn a_failed_job_keeps_the_drivers_error_as_its_source() {
        let cause = JobCause::new(std::io::Error::other("the executor is gone"));
        let e = EngineError::Job(JobFailure::Failed { id: 7, cause });
        assert_eq!(e.to_string(), "compute job failed: job 7: the executor is gone");
        let failure = e.source().expect("the failure");
        assert!(failure.is::<JobFailure>());
        let driver = failure.source().expect("the driver's error");
        assert!(driver.is::<std::io::Error>(), "{driver:?}");
        // Causes compare by what they say, as the text the engine used to keep did.
        assert_eq!(e.clone(), e);
        assert_eq!(
            JobCause::new(std::io::Error::other("a")),
            JobCause::new(std::io::Error::other("a"))
        );
        assert_ne!(
            JobCause::new(std::io::Error::other("a")),
            JobCause::new(std::io::Error::other("b"))
        );
    }
}
