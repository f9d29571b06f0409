//! Where a rank's buffers lie: the offsets of every layer in its parameter,
//! view, gradient, factor and sparse buffers, the bytes of each region the
//! runtime allocates, and the checks on a caller's layout and on the
//! transport's limits and the job's modes that [`super::Node::new`] runs first.

use super::flow::{CELLS, CELL_BYTES};
use super::types::{Limits, LocalRegion};
use crate::book::{Book, LayerKind, LayerSpec, Placement, Role, Scheme, SchemePolicy};
use crate::config::{Consistency, SchedConfig, Trigger};
use crate::error::{EngineError, Result};
use crate::wire;

/// The transport's limits leave room for the protocol's control messages.
pub(super) fn check_limits(l: &Limits) -> Result<()> {
    if l.max_outstanding == 0 {
        return Err(EngineError::InvalidConfig(
            "the transport's max_outstanding must be at least 1".into(),
        ));
    }
    if l.max_message_bytes < wire::MAX_CONTROL || l.max_write_bytes < 4 {
        return Err(EngineError::InvalidConfig(format!(
            "the transport's limits are too small: messages of {} bytes (at least {} needed), writes of {} bytes",
            l.max_message_bytes,
            wire::MAX_CONTROL,
            l.max_write_bytes
        )));
    }
    Ok(())
}

/// The schemes, placement, consistency and trigger go together: SFB and
/// Adam need every worker's factors of one iteration, the kvstore pulls every
/// version (BSP, all).
pub(super) fn check_modes(book: &Book, sched: &SchedConfig) -> Result<()> {
    let nl = book.layers().len() as u32;
    if sched.trigger != Trigger::All {
        if let Some(l) = (0..nl).find(|&l| book.scheme(l, 0) == Scheme::Sfb) {
            return Err(EngineError::InvalidConfig(format!(
                "layer {l} ({}) syncs by SFB, which needs every worker's factors: the {} trigger needs the PS for every layer (scheme policy ps)",
                book.layers()[l as usize].name,
                sched.trigger.name()
            )));
        }
    }
    if book.config().policy == SchemePolicy::Adam
        && (sched.consistency != Consistency::Bsp || sched.trigger != Trigger::All)
    {
        return Err(EngineError::InvalidConfig(format!(
            "adam (the server rebuilds each FC layer from every worker's factors of one iteration) supports BSP with the all trigger only, not {:?} with {}",
            sched.consistency,
            sched.trigger.name()
        )));
    }
    if book.config().placement == Placement::KvStore {
        if sched.consistency != Consistency::Bsp {
            return Err(EngineError::InvalidConfig(
                "kvstore (MXNet's dist_sync: notify, then pull) supports BSP only, not SSP".into(),
            ));
        }
        if sched.trigger != Trigger::All {
            return Err(EngineError::InvalidConfig(format!(
                "kvstore pulls every version of every chunk (BSP): the {} trigger needs another --sync mode",
                sched.trigger.name()
            )));
        }
    }
    Ok(())
}

/// Scheme switches ([`crate::plan`]) hand a layer's parameters over at an
/// iteration boundary and nothing else: they need BSP with the all trigger
/// (every worker at one iteration per layer, and a deterministic order),
/// and the chunked placement (kvstore's versions count every iteration).
/// Every apply op may switch: an op's momentum moves with the layer
/// ([`crate::plan`]); `apply` is the op (kept for callers that check
/// before building a Node).
pub fn check_switches(book: &Book, sched: &SchedConfig, apply: crate::config::ApplyOp) -> Result<()> {
    // SGD's momentum moves at switches: no op is refused for its state.
    debug_assert!(matches!(
        apply,
        crate::config::ApplyOp::Sum | crate::config::ApplyOp::Mean | crate::config::ApplyOp::Sgd { .. }
    ));
    let first = match book.plan().switches().next() {
        Some(sw) => sw.to_string(),
        None if book.plan().every() > 0 => format!("decided every {} iterations", book.plan().every()),
        None => return Ok(()),
    };
    let why = if sched.consistency != Consistency::Bsp || sched.trigger != Trigger::All {
        format!(
            "BSP with the all trigger, not {:?} with {}",
            sched.consistency,
            sched.trigger.name()
        )
    } else if book.config().placement != Placement::Chunked {
        "the chunked placement, not kvstore".to_string()
    } else {
        // The layers a switch may move are the dense FC ones.
        debug_assert!(book
            .plan()
            .switches()
            .all(|s| book.layers()[s.layer as usize].kind == LayerKind::Fc));
        return Ok(());
    };
    Err(EngineError::InvalidConfig(format!(
        "scheme switches ({first}, ...) need {why}"
    )))
}

/// A rank's buffer layout (see the fields of the same names in [`super::Node`]).
pub(super) struct Layout {
    /// The caller reads a view published from the landing zone (SSP, or a
    /// trigger other than `All`): a server may write a layer the caller holds.
    pub(super) staged: bool,
    pub(super) param_off: Vec<u64>,
    pub(super) view_off: Vec<u64>,
    pub(super) grad_off: Vec<u64>,
    pub(super) factor_off: Vec<Option<u64>>,
    pub(super) sparse_off: Vec<Option<u64>>,
    /// Where momentum moves at switches: per layer, its momentum in the
    /// `Moments` region (a worker's movable layers), and where the shard's
    /// momentum starts there (a server's). `None`: it does not move.
    pub(super) moments: Option<Moments>,
    /// Bytes of each region, by [`region_index`].
    pub(super) bytes: [u64; 9],
    /// Bytes of one landing slot (the largest slice).
    pub(super) slot_bytes: u64,
}

/// The `Moments` region's layout (see [`LocalRegion::Moments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Moments {
    /// Per layer: a worker's momentum of it, where it may switch.
    pub(super) layer_off: Vec<Option<u64>>,
    /// Where a server's shard momentum starts (its chunks at their shard offsets).
    pub(super) shard_at: u64,
}

impl Moments {
    /// The layout where momentum moves at switches (`moves`), else `None`:
    /// a worker's movable layers back to back, then a server's whole shard.
    fn new(book: &Book, rank: u32, role: Role, moves: bool) -> (Option<Moments>, u64) {
        if !moves {
            return (None, 0);
        }
        let plan = book.plan();
        let mut at = 0u64;
        let layer_off = (0..book.layers().len() as u32)
            .map(|l| {
                (role.is_worker() && plan.movable(l)).then(|| {
                    at += book.layers()[l as usize].params() as u64 * 4;
                    at - book.layers()[l as usize].params() as u64 * 4
                })
            })
            .collect();
        let shard = if role.is_server() {
            book.shard_len(rank) as u64 * 4
        } else {
            0
        };
        // The worker's part, then the server's.
        debug_assert!(role.is_worker() || at == 0);
        (
            Some(Moments {
                layer_off,
                shard_at: at,
            }),
            at + shard,
        )
    }
}

impl Layout {
    /// The layout for `rank` with the caller's parameter and gradient
    /// offsets (checked), or back to back where it gives none; `moves`:
    /// momentum moves at scheme switches (the `Moments` region).
    pub(super) fn new(
        book: &Book,
        rank: u32,
        role: Role,
        sched: &SchedConfig,
        (params, grads): (Option<Vec<u64>>, Option<Vec<u64>>),
        moves: bool,
    ) -> Result<Layout> {
        let nl = book.layers().len();
        let contiguous: Vec<u64> = (0..nl as u32).map(|i| book.layer_offset(i) as u64 * 4).collect();
        let user_params = caller_offsets(book, params, &contiguous, "parameter", true)?;
        let grad_off = caller_offsets(book, grads, &contiguous, "gradient", false)?;
        // Under SSP a server may write a layer the caller holds: the caller
        // reads a view published from the landing zone instead.
        // So does any trigger but `All`: a slow worker gets newer versions
        // while it computes.
        let staged = role.is_worker() && (sched.consistency != Consistency::Bsp || sched.trigger != Trigger::All);
        let (param_off, view_off) = if staged {
            (contiguous, user_params)
        } else {
            (user_params, Vec::new())
        };
        let k = book.config().batch as u64;
        let (factor_off, factors_bytes) = packed(book, |s| {
            (s.kind == LayerKind::Fc && role.is_worker()).then(|| k * (s.m + s.n) as u64 * 4)
        });
        let (sparse_off, sparse_bytes) =
            packed(book, |s| (s.sparse && role.is_worker()).then(|| s.params() as u64 * 4));
        let slot_bytes = book.max_slice_len() as u64 * 4;
        debug_assert!(slot_bytes > 0, "every layer has parameters");
        let mut bytes = [0u64; 9];
        if role.is_worker() {
            bytes[region_index(LocalRegion::Params)] = extent(book, &param_off);
            bytes[region_index(LocalRegion::View)] = if staged { extent(book, &view_off) } else { 0 };
            bytes[region_index(LocalRegion::Grads)] = extent(book, &grad_off);
            bytes[region_index(LocalRegion::Factors)] = factors_bytes;
            bytes[region_index(LocalRegion::Sparse)] = sparse_bytes;
        }
        if role.is_server() {
            bytes[region_index(LocalRegion::Shard)] = book.shard_len(rank) as u64 * 4;
            bytes[region_index(LocalRegion::Landing)] = sched.landing_bytes(book);
        }
        bytes[region_index(LocalRegion::Ctrl)] = (CELLS * CELL_BYTES) as u64;
        let (moments, moments_bytes) = Moments::new(book, rank, role, moves);
        bytes[region_index(LocalRegion::Moments)] = moments_bytes;
        debug_assert_eq!(param_off.len(), nl);
        debug_assert_eq!(grad_off.len(), nl);
        debug_assert_eq!(view_off.len(), if staged { nl } else { 0 });
        // The caller's buffers hold every layer.
        let total = book.total_params() as u64 * 4;
        debug_assert!(!role.is_worker() || bytes[region_index(LocalRegion::Params)] >= total);
        debug_assert!(!role.is_worker() || bytes[region_index(LocalRegion::Grads)] >= total);
        // The landing region holds every worker's slots.
        debug_assert!(!role.is_server() || bytes[region_index(LocalRegion::Landing)] >= slot_bytes * book.p1() as u64);
        Ok(Layout {
            staged,
            param_off,
            view_off,
            grad_off,
            factor_off,
            sparse_off,
            moments,
            bytes,
            slot_bytes,
        })
    }
}

/// The caller's offsets of its `what` buffer (checked, and back to back
/// where `back_to_back`), or the `default` ones where it gives none.
fn caller_offsets(
    book: &Book,
    given: Option<Vec<u64>>,
    default: &[u64],
    what: &str,
    back_to_back: bool,
) -> Result<Vec<u64>> {
    let offs = match given {
        Some(o) => {
            check_offsets(book, &o, what, back_to_back)?;
            o
        }
        None => default.to_vec(),
    };
    debug_assert_eq!(offs.len(), book.layers().len(), "{what} offsets");
    Ok(offs)
}

/// Back-to-back offsets of the layers that `size` gives a size, and the
/// total.
fn packed(book: &Book, size: impl Fn(&LayerSpec) -> Option<u64>) -> (Vec<Option<u64>>, u64) {
    let mut total = 0u64;
    let offs = book
        .layers()
        .iter()
        .map(|s| {
            size(s).map(|b| {
                let at = total;
                total += b;
                at
            })
        })
        .collect::<Vec<_>>();
    // Back to back: each offset below the total, in order.
    debug_assert!(offs.iter().flatten().all(|&o| o < total));
    debug_assert!(offs
        .iter()
        .flatten()
        .zip(offs.iter().flatten().skip(1))
        .all(|(a, b)| a < b));
    (offs, total)
}

fn extent(book: &Book, offs: &[u64]) -> u64 {
    offs.iter()
        .zip(book.layers())
        .map(|(o, l)| o + l.params() as u64 * 4)
        .max()
        .unwrap_or(0)
}

fn check_offsets(book: &Book, offs: &[u64], what: &str, contiguous: bool) -> Result<()> {
    let bad = |m: String| Err(EngineError::InvalidConfig(format!("{what} buffer: {m}")));
    if offs.len() != book.layers().len() {
        return bad(format!("{} offsets for {} layers", offs.len(), book.layers().len()));
    }
    let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
    for (i, (&o, l)) in offs.iter().zip(book.layers()).enumerate() {
        if o % 4 != 0 {
            return bad(format!("layer {i} ({}) starts at {o}, not a multiple of 4", l.name));
        }
        if contiguous && o - offs[0].min(o) != book.layer_offset(i as u32) as u64 * 4 {
            return bad(format!(
                "layer {i} starts at {o}, but parameters must be back to back from {} (expected {})",
                offs[0],
                offs[0] + book.layer_offset(i as u32) as u64 * 4
            ));
        }
        ranges.push((o, o + l.params() as u64 * 4, i));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return bad(format!(
                "layers {} ({}) and {} ({}) overlap",
                w[0].2,
                book.layers()[w[0].2].name,
                w[1].2,
                book.layers()[w[1].2].name
            ));
        }
    }
    Ok(())
}

pub(super) fn region_index(r: LocalRegion) -> usize {
    LocalRegion::ALL.iter().position(|x| *x == r).expect("listed")
}
