//! What every rank of a job must agree on, field by field.
//!
//! [`JobConfig`] gathers the information book (cluster, layer table, dtypes,
//! batch, chunk and slice sizes, scheme policy), the scheduler settings every
//! rank depends on (slots, consistency, deterministic order, queue order), the
//! apply op with its hyper-parameters, and the transport kind. Its
//! [`fields`](JobConfig::fields) travel in the rendezvous and in every hello;
//! a mismatch names the field, the rank and both values
//! ([`EngineError::Disagree`]).
//!
//! The credit window (`SchedConfig::credit_bytes`) is deliberately left out:
//! it shapes only the sender's own scheduling, so ranks may tune it apart.

use crate::book::Book;
use crate::config::{ApplyOp, Consistency, QueueOrder, SchedConfig};
use crate::error::EngineError;
use crate::freq::{CommConfig, CommMode};

/// One agreed field. The id is its wire value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Field {
    /// Roles of every rank (hash).
    Cluster = 0,
    /// Names, kinds and shapes of the layer table (hash).
    Layers = 1,
    /// Element types of the layer table (hash).
    Dtypes = 2,
    /// Batch size K.
    Batch = 3,
    /// KV chunk size in bytes.
    ChunkBytes = 4,
    /// Slice size in parameters.
    SliceParams = 5,
    /// Scheme policy, and the chunk placement ([`crate::book::Placement`])
    /// in bits 8.. (0, chunked, for every mode but kvstore, so the value is
    /// the policy alone there). One field rather than two: a hello with every
    /// field must fit one control cell.
    Policy = 6,
    /// Send order.
    Order = 7,
    /// Landing slots per worker.
    Slots = 8,
    /// BSP or SSP(s).
    Consistency = 9,
    /// Fixed-order aggregation.
    Deterministic = 10,
    /// Apply op.
    Apply = 11,
    /// SGD learning rate (f32 bits).
    Lr = 12,
    /// SGD momentum (f32 bits).
    Momentum = 13,
    /// SGD weight decay (f32 bits).
    WeightDecay = 14,
    /// Transport kind (hash of its name).
    Transport = 15,
    /// Workers per deterministic fold group.
    FoldGroup = 16,
    /// Local learners per worker rank.
    Learners = 17,
    /// Communication frequency: the original T (steps per exchange).
    CommEvery = 18,
    /// What learners do between exchanges.
    CommMode = 19,
    /// Quality-guided adjustment: T bounds, period, tolerance, reversion (hash).
    FreqGuide = 20,
    /// Aggregation trigger ([`crate::config::Trigger::encode`]).
    Trigger = 21,
    /// The caller's checkpoint settings and the iteration a resumed job
    /// starts from (a fingerprint; 0 without checkpoints): every rank must
    /// checkpoint alike and resume the same checkpoint.
    Checkpoint = 22,
}

impl Field {
    /// How many fields there are.
    pub const COUNT: usize = 23;

    /// The field with wire id `id`.
    pub fn from_id(id: u8) -> Option<Field> {
        use Field::*;
        const ALL: [Field; Field::COUNT] = [
            Cluster,
            Layers,
            Dtypes,
            Batch,
            ChunkBytes,
            SliceParams,
            Policy,
            Order,
            Slots,
            Consistency,
            Deterministic,
            Apply,
            Lr,
            Momentum,
            WeightDecay,
            Transport,
            FoldGroup,
            Learners,
            CommEvery,
            CommMode,
            FreqGuide,
            Trigger,
            Checkpoint,
        ];
        let f = ALL.get(id as usize).copied();
        // The table is in id order: a field's id is its wire value.
        debug_assert!(f.map_or(true, |f| f as u8 == id));
        f
    }

    /// The field's name as users set it.
    pub fn name(self) -> &'static str {
        match self {
            Field::Cluster => "cluster (roles of the ranks)",
            Field::Layers => "layer table",
            Field::Dtypes => "layer dtypes",
            Field::Batch => "batch",
            Field::ChunkBytes => "chunk_bytes",
            Field::SliceParams => "slice_params",
            Field::Policy => "scheme policy and placement",
            Field::Order => "queue order",
            Field::Slots => "slots",
            Field::Consistency => "consistency",
            Field::Deterministic => "deterministic",
            Field::Apply => "apply op",
            Field::Lr => "learning rate",
            Field::Momentum => "momentum",
            Field::WeightDecay => "weight decay",
            Field::Transport => "transport",
            Field::FoldGroup => "fold group (--local-learners of a flat run)",
            Field::Learners => "local learners per worker",
            Field::CommEvery => "comm_every (steps per exchange)",
            Field::CommMode => "comm_mode",
            Field::FreqGuide => "quality-guided frequency (t_max, period, tolerance, revert step)",
            Field::Trigger => "aggregation trigger",
            Field::Checkpoint => "checkpoints (every, framework state, the resumed iteration)",
        }
    }

    /// A value of this field, as text.
    pub fn render(self, v: u64) -> String {
        match self {
            Field::Cluster
            | Field::Layers
            | Field::Dtypes
            | Field::Transport
            | Field::FreqGuide
            | Field::Checkpoint => {
                format!("hash {v:#018x}")
            }
            Field::CommMode => ["accumulate", "average"].get(v as usize).unwrap_or(&"?").to_string(),
            Field::Policy => {
                let policy = ["hybrid", "ps", "sfb", "adam"].get((v & 0xff) as usize).unwrap_or(&"?");
                let placed = match (v >> 8) & 0xff {
                    0 => policy.to_string(),
                    1 => format!("{policy}, kvstore placement"),
                    p => format!("{policy}, placement {p}"),
                };
                match v >> 16 {
                    0 => placed,
                    f => format!("{placed}, decided in seconds from measured rates (schemes {f:#012x})"),
                }
            }
            Field::Order => ["priority", "fifo"].get(v as usize).unwrap_or(&"?").to_string(),
            Field::Consistency => match v {
                0 => "bsp".into(),
                s => format!("ssp:{}", s - 1),
            },
            Field::Deterministic => (v != 0).to_string(),
            Field::Slots => format!("{} + {} spare", v & 0xffff_ffff, v >> 32),
            Field::Trigger => match v >> 56 {
                0 => "all".into(),
                1 => format!("quorum:{}", v & 0xffff_ffff),
                2 => "async".into(),
                3 => format!("timeout:{}ms", (v & ((1 << 56) - 1)) as f64 / 1e6),
                _ => format!("{v:#x}"),
            },
            Field::Apply => ["sum", "mean", "sgd"].get(v as usize).unwrap_or(&"?").to_string(),
            Field::Lr | Field::Momentum | Field::WeightDecay => f32::from_bits(v as u32).to_string(),
            _ => v.to_string(),
        }
    }
}

/// FNV-1a, for canonical encodings.
pub(crate) fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // Separate parts, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Everything the ranks of one job must agree on.
#[derive(Debug, Clone, PartialEq)]
pub struct JobConfig {
    fields: Vec<(Field, u64)>,
}

impl JobConfig {
    /// The configuration of a job: its book, scheduler settings, apply op and transport kind.
    pub fn new(book: &Book, sched: &SchedConfig, op: ApplyOp, transport: &str) -> Self {
        let sched = &sched.resolve(book);
        let roles: Vec<u8> = book.cluster().roles().iter().map(|r| *r as u8).collect();
        let mut layer_parts: Vec<Vec<u8>> = Vec::new();
        let mut dtypes = Vec::new();
        for l in book.layers() {
            let mut b = l.name.as_bytes().to_vec();
            b.push(0);
            b.push(l.kind as u8);
            b.extend_from_slice(&(l.m as u64).to_le_bytes());
            b.extend_from_slice(&(l.n as u64).to_le_bytes());
            b.push(u8::from(l.sparse));
            layer_parts.push(b);
            dtypes.push(l.dtype as u8);
        }
        let parts: Vec<&[u8]> = layer_parts.iter().map(Vec::as_slice).collect();
        let cfg = book.config();
        let (apply, lr, mom, wd) = match op {
            ApplyOp::Sum => (0, 0.0f32, 0.0f32, 0.0f32),
            ApplyOp::Mean => (1, 0.0, 0.0, 0.0),
            ApplyOp::Sgd {
                lr,
                momentum,
                weight_decay,
            } => (2, lr, momentum, weight_decay),
        };
        let fields = vec![
            (Field::Cluster, fnv(&[&roles])),
            (Field::Layers, fnv(&parts)),
            (Field::Dtypes, fnv(&[&dtypes])),
            (Field::Batch, cfg.batch as u64),
            (Field::ChunkBytes, cfg.chunk_bytes as u64),
            (Field::SliceParams, cfg.slice_params as u64),
            (
                Field::Policy,
                cfg.policy as u64 | (cfg.placement as u64) << 8 | book.scheme_fingerprint() << 16,
            ),
            (
                Field::Order,
                match sched.order {
                    QueueOrder::Priority => 0,
                    QueueOrder::Fifo => 1,
                },
            ),
            (
                Field::Slots,
                u64::from(sched.slots) | u64::from(sched.spare_slots) << 32,
            ),
            (
                Field::Consistency,
                match sched.consistency {
                    Consistency::Bsp => 0,
                    Consistency::Ssp(s) => u64::from(s) + 1,
                },
            ),
            (Field::Deterministic, u64::from(sched.deterministic)),
            (Field::Apply, apply),
            (Field::Lr, u64::from(lr.to_bits())),
            (Field::Momentum, u64::from(mom.to_bits())),
            (Field::WeightDecay, u64::from(wd.to_bits())),
            (Field::Transport, fnv(&[transport.as_bytes()])),
            (Field::FoldGroup, u64::from(sched.fold_group)),
            (Field::Learners, u64::from(sched.learners)),
        ];
        let mut j = JobConfig { fields }.with_comm(&CommConfig::default());
        j.fields.push((Field::Trigger, sched.trigger.encode()));
        j.fields.push((Field::Checkpoint, 0));
        // Every field once, in id order (`check` compares the counts).
        debug_assert_eq!(j.fields.len(), Field::COUNT);
        debug_assert!(j.fields.windows(2).all(|w| w[0].0 < w[1].0));
        j
    }

    /// Sets the checkpoint fingerprint (see [`Field::Checkpoint`]).
    pub fn with_checkpoint(mut self, fingerprint: u64) -> Self {
        match self.fields.iter_mut().find(|(g, _)| *g == Field::Checkpoint) {
            Some(e) => e.1 = fingerprint,
            None => self.fields.push((Field::Checkpoint, fingerprint)),
        }
        debug_assert!(self.fields.windows(2).all(|w| w[0].0 < w[1].0), "fields in id order");
        self
    }

    /// A fingerprint of checkpoint settings for [`JobConfig::with_checkpoint`].
    pub fn checkpoint_fingerprint(parts: &[&[u8]]) -> u64 {
        fnv(parts).max(1)
    }

    /// Sets the communication frequency fields (default: every step, no adjustment).
    pub fn with_comm(mut self, c: &CommConfig) -> Self {
        let mode = match c.mode {
            CommMode::Accumulate => 0,
            CommMode::Average => 1,
        };
        let vals = [
            (Field::CommEvery, u64::from(c.freq.t_initial)),
            (Field::CommMode, mode),
            (Field::FreqGuide, fnv(&[&c.freq.encode()])),
        ];
        for (f, v) in vals {
            match self.fields.iter_mut().find(|(g, _)| *g == f) {
                Some(e) => e.1 = v,
                None => self.fields.push((f, v)),
            }
        }
        debug_assert!(self.fields.windows(2).all(|w| w[0].0 < w[1].0), "fields in id order");
        self
    }

    /// The fields, in id order.
    pub fn fields(&self) -> &[(Field, u64)] {
        &self.fields
    }

    /// One digest of every field.
    pub fn digest(&self) -> u64 {
        // Ranks digest the same fields in the same order.
        debug_assert!(self.fields.windows(2).all(|w| w[0].0 < w[1].0));
        let enc: Vec<u8> = self
            .fields
            .iter()
            .flat_map(|(f, v)| std::iter::once(*f as u8).chain(v.to_le_bytes()))
            .collect();
        fnv(&[&enc])
    }

    /// Checks `rank`'s fields against ours; the first difference names the field.
    pub fn check(&self, rank: u32, theirs: &[(Field, u64)]) -> Result<(), EngineError> {
        debug_assert_eq!(self.fields.len(), Field::COUNT, "ours has every field");
        for &(f, ours) in &self.fields {
            match theirs.iter().find(|(g, _)| *g == f) {
                Some(&(_, v)) if v == ours => {}
                Some(&(_, v)) => {
                    return Err(EngineError::Disagree {
                        rank,
                        field: f.name(),
                        theirs: f.render(v),
                        reference: "this rank".into(),
                        ours: f.render(ours),
                    })
                }
                None => {
                    return Err(EngineError::Disagree {
                        rank,
                        field: f.name(),
                        theirs: "absent".into(),
                        reference: "this rank".into(),
                        ours: f.render(ours),
                    })
                }
            }
        }
        if theirs.len() != self.fields.len() {
            return Err(EngineError::field_count(rank, theirs.len(), self.fields.len()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::book::{BookConfig, Cluster, LayerKind, LayerSpec};
    use crate::freq::FreqConfig;
    use std::sync::Arc;

    fn book(batch: usize) -> Arc<Book> {
        Arc::new(
            Book::new(
                Cluster::split(2, 1).unwrap(),
                vec![LayerSpec::new("fc", LayerKind::Fc, 10, 20)],
                BookConfig {
                    batch,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    }

    #[test]
    fn ranks_whose_rates_lead_to_other_schemes_disagree_on_the_policy() {
        let big = |gemm: f64| {
            let b = Book::new(
                Cluster::split(4, 1).unwrap(),
                vec![LayerSpec::new("fc", LayerKind::Fc, 4096, 4096)],
                BookConfig {
                    batch: 128,
                    ..Default::default()
                },
            )
            .unwrap();
            let r = crate::cost::Rates {
                link_bytes_per_s: 3e9,
                msg_s: 1e-5,
                sum_bytes_per_s: 5e9,
                gemm_flop_per_s: gemm,
                host_ranks: 1,
                link_on_host: false,
                ps_builds_grad: false,
            };
            Arc::new(b.with_rates(r).unwrap())
        };
        let s = SchedConfig::default();
        let (cpu, cpu2, gpu) = (big(20e9), big(25e9), big(50e12));
        let a = JobConfig::new(&cpu, &s, ApplyOp::Mean, "tcp");
        // Other rates, the same schemes: they agree.
        assert!(a
            .check(1, JobConfig::new(&cpu2, &s, ApplyOp::Mean, "tcp").fields())
            .is_ok());
        match a.check(2, JobConfig::new(&gpu, &s, ApplyOp::Mean, "tcp").fields()) {
            Err(EngineError::Disagree {
                field, theirs, ours, ..
            }) => {
                assert_eq!(field, "scheme policy and placement");
                assert!(theirs.contains("decided in seconds") && ours.contains("decided in seconds"));
                assert_ne!(theirs, ours);
            }
            other => panic!("{other:?}"),
        }
        // A book deciding in bytes keeps its old value: the policy alone.
        assert_eq!(Field::Policy.render(0), "hybrid");
    }

    #[test]
    fn every_field_is_named_on_mismatch() {
        let s = SchedConfig::default();
        let a = JobConfig::new(&book(32), &s, ApplyOp::Mean, "tcp");
        assert!(a.check(1, a.fields()).is_ok());
        let b = JobConfig::new(&book(64), &s, ApplyOp::Mean, "tcp");
        let e = a.check(3, b.fields()).unwrap_err();
        assert_eq!(
            e,
            EngineError::Disagree {
                rank: 3,
                field: "batch",
                theirs: "64".into(),
                reference: "this rank".into(),
                ours: "32".into(),
            }
        );
        let slots = SchedConfig { slots: 4, ..s };
        let c = JobConfig::new(&book(32), &slots, ApplyOp::Mean, "tcp");
        assert!(matches!(
            a.check(1, c.fields()),
            Err(EngineError::Disagree { field: "slots", .. })
        ));
        let q = SchedConfig {
            trigger: crate::config::Trigger::Quorum(2),
            ..s
        };
        let d = JobConfig::new(&book(32), &q, ApplyOp::Mean, "tcp");
        match a.check(1, d.fields()) {
            Err(EngineError::Disagree {
                field, theirs, ours, ..
            }) => {
                assert_eq!(
                    (field, theirs.as_str(), ours.as_str()),
                    ("aggregation trigger", "quorum:2", "all")
                );
            }
            other => panic!("{other:?}"),
        }
        let sgd = |lr| ApplyOp::Sgd {
            lr,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let d = JobConfig::new(&book(32), &s, sgd(0.1), "tcp");
        let e = JobConfig::new(&book(32), &s, sgd(0.2), "tcp");
        let err = d.check(2, e.fields()).unwrap_err().to_string();
        assert!(
            err.contains("learning rate") && err.contains("0.1") && err.contains("0.2"),
            "{err}"
        );
        let f = JobConfig::new(&book(32), &s, ApplyOp::Mean, "rdma");
        assert!(matches!(
            a.check(1, f.fields()),
            Err(EngineError::Disagree { field: "transport", .. })
        ));
        assert_ne!(a.digest(), f.digest());
        let every = |mode, freq| a.clone().with_comm(&CommConfig { mode, freq });
        let t4 = every(CommMode::Accumulate, FreqConfig::fixed(4));
        assert_eq!(t4.fields().len(), Field::COUNT);
        let e = a.check(1, t4.fields()).unwrap_err().to_string();
        assert!(e.contains("comm_every") && e.contains('4') && e.contains('1'), "{e}");
        assert!(matches!(
            t4.check(1, every(CommMode::Average, FreqConfig::fixed(4)).fields()),
            Err(EngineError::Disagree { field: "comm_mode", .. })
        ));
        let guided = FreqConfig {
            t_max: 16,
            period: 4,
            tolerance: 0.02,
            ..FreqConfig::fixed(4)
        };
        let g = every(CommMode::Average, guided);
        let g2 = every(
            CommMode::Average,
            FreqConfig {
                tolerance: 0.03,
                ..guided
            },
        );
        assert!(matches!(
            g.check(1, g2.fields()),
            Err(EngineError::Disagree { field, .. }) if field.starts_with("quality-guided")
        ));
        assert!(g.check(1, g.clone().fields()).is_ok());
    }

    #[test]
    fn field_ids_round_trip() {
        for i in 0..Field::COUNT as u8 {
            assert_eq!(Field::from_id(i).map(|f| f as u8), Some(i));
        }
        assert_eq!(Field::from_id(Field::COUNT as u8), None);
    }
}
