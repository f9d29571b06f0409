//! Checkpoints: consistent snapshots of a job, written atomically in the
//! [safetensors](https://huggingface.co/docs/safetensors) format, and resume
//! from them.
//!
//! # What a checkpoint holds
//! The checkpoint of iteration `k` (every [`Checkpointing::every`]
//! iterations) is the directory `DIR/step-{k:08}/`:
//! - `model.safetensors`: every layer's parameters after `k` iterations,
//!   named as the layer, shape `[m, n]`, f32; and the momentum of the layers
//!   a worker updates itself (sufficient-factor layers) as `momentum/{layer}`.
//!   Worker 0 writes it from its parameter buffers the moment every layer is
//!   synced for iteration `k - 1` (under BSP these are bitwise the servers'
//!   values).
//! - `server-{rank}.safetensors`, one per server that holds chunks, when the
//!   op keeps momentum (SGD with momentum): its chunks' momentum as 1-D
//!   pieces `momentum/{layer}/{first element}`. Each server copies a chunk's
//!   momentum right after it applies iteration `k - 1` to it, so every server
//!   snapshots the same iteration.
//! - `framework.bin`, when the job declares a framework state
//!   ([`Checkpointing::framework_state`]): the learner's opaque blob
//!   ([`Session::save_framework_state`](crate::Session::save_framework_state)),
//!   e.g. a PyTorch `state_dict`.
//! - `manifest.json`: the iteration, the run, the layers and the files above.
//!
//! Every file is written to a temporary name, fsynced, renamed into place,
//! and the directory fsynced: a file that exists is whole. Every file's
//! metadata names the iteration and the run (a hash of the job's secret and
//! id), and a checkpoint is **complete** when every file its manifest lists
//! exists and names the same iteration and run. Worker 0 keeps the newest
//! [`Checkpointing::keep`] complete checkpoints and removes older ones.
//!
//! Writing happens on a thread of its own; the runtime and the server
//! executor only copy the values (a memcpy of the model on worker 0, of the
//! shard's momentum on a server) every `every` iterations.
//!
//! # Resume
//! [`Builder::resume`](crate::Builder::resume) loads a complete checkpoint
//! ([`Loaded::open`]): the parameters become every rank's initial values, the
//! servers and workers take their momentum from it, and the session counts
//! iterations from `k` ([`Session::start_iteration`](crate::Session::start_iteration)).
//! Momentum is kept in layer coordinates, so a job may resume on another
//! number of servers.
//!
//! ```no_run
//! # fn main() -> Result<(), tidewire::Error> {
//! use tidewire::checkpoint::{Checkpointing, Loaded};
//! let every_100 = Checkpointing::new("/data/ckpt", 100);
//! // What a resumed job would start from: the newest complete checkpoint.
//! if let Some(step) = Loaded::newest_complete("/data/ckpt")? {
//!     println!("would resume from {}", step.display());
//! }
//! # let _ = every_100; Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use serde_json::{json, Value};
use tidewire_engine::{ApplyOp, Book, Scheme};

use crate::error::{Error, Result};

/// The format name in every file's metadata and in the manifest.
pub const FORMAT: &str = "tidewire-checkpoint";
/// The format version.
pub const VERSION: u64 = 1;
/// The largest safetensors header read (bytes).
const MAX_HEADER: u64 = 64 << 20;

/// How a job checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpointing {
    /// The directory of the `step-*` directories.
    pub dir: PathBuf,
    /// Every this many iterations (at least 1).
    pub every: u64,
    /// Complete checkpoints kept (at least 1; default 2).
    pub keep: usize,
    /// Whether a checkpoint also needs the learner's framework state
    /// (`framework.bin`) to be complete.
    pub framework_state: bool,
}

impl Checkpointing {
    /// Every `every` iterations into `dir`, keeping 2, no framework state.
    pub fn new(dir: impl Into<PathBuf>, every: u64) -> Self {
        Checkpointing {
            dir: dir.into(),
            every,
            keep: 2,
            framework_state: false,
        }
    }
    pub(crate) fn validate(&self) -> Result<()> {
        if self.every == 0 {
            return Err(Error::Checkpoint(
                "checkpoint every 0 iterations: give at least 1".into(),
            ));
        }
        if self.keep == 0 {
            return Err(Error::Checkpoint("keep at least 1 checkpoint".into()));
        }
        Ok(())
    }
}

/// The chunks of `server`'s shard that it applies (those of layers synced
/// through the PS; an SFB layer's chunks are never applied).
pub(crate) fn ps_chunks(book: &Book, server: u32) -> usize {
    book.server_chunks(server)
        .iter()
        .filter(|&&c| book.scheme(book.chunks()[c as usize].layer, 0) != Scheme::Sfb)
        .count()
}

/// The directory of iteration `k`'s checkpoint under `dir`.
pub fn step_dir(dir: &Path, k: u64) -> PathBuf {
    dir.join(format!("step-{k:08}"))
}

fn step_of(name: &str) -> Option<u64> {
    name.strip_prefix("step-")?.parse().ok()
}

/// A run's identity: the files of one checkpoint come from one run.
pub(crate) fn run_id(fingerprint: u64, job: u64) -> String {
    format!("{fingerprint:016x}-{job}")
}

// ---------------------------------------------------------------------------
// safetensors

/// One f32 tensor to write.
#[derive(Debug, Clone)]
pub(crate) struct Tensor {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) data: Vec<f32>,
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Checkpoint(format!("{what} {}: {e}", path.display()))
}

/// Writes `bytes` (from `fill`) to `path` atomically: a temporary file in the
/// same directory, fsync, rename, fsync of the directory.
fn write_atomic(path: &Path, fill: impl FnOnce(&mut BufWriter<fs::File>) -> std::io::Result<()>) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| io_err("cannot create", dir, e))?;
    // Unique per process and per write: ranks of one process (threads) write
    // the same names (the manifest) at once.
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| io_err("cannot create", &tmp, e))?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    let r = fill(&mut w)
        .and_then(|()| w.flush())
        .and_then(|()| w.get_ref().sync_all());
    if let Err(e) = r {
        let _ = fs::remove_file(&tmp);
        return Err(io_err("cannot write", &tmp, e));
    }
    drop(w);
    fs::rename(&tmp, path).map_err(|e| io_err("cannot rename into", path, e))?;
    // The rename is durable once the directory is.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes f32 tensors and string metadata as one safetensors file, atomically.
pub(crate) fn write_safetensors(path: &Path, tensors: &[Tensor], meta: &BTreeMap<String, String>) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!(meta));
    let mut at = 0usize;
    for t in tensors {
        let n: usize = t.shape.iter().product();
        if n != t.data.len() {
            return Err(Error::Checkpoint(format!(
                "tensor {}: shape {:?} holds {n} values, not {}",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
        header.insert(
            t.name.clone(),
            json!({"dtype": "F32", "shape": t.shape, "data_offsets": [at, at + 4 * n]}),
        );
        at += 4 * n;
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("a JSON map serializes");
    // Pad the header to 8 bytes (with spaces, as the format allows) so the data is aligned.
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    write_atomic(path, |w| {
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        let mut buf = Vec::with_capacity(64 << 10);
        for t in tensors {
            for c in t.data.chunks(16 << 10) {
                buf.clear();
                for x in c {
                    buf.extend_from_slice(&x.to_le_bytes());
                }
                w.write_all(&buf)?;
            }
        }
        Ok(())
    })
}

/// A safetensors file read back: f32 tensors by name, and the metadata.
#[derive(Debug, Clone, Default)]
pub struct SafeTensors {
    /// Name → (shape, values).
    pub tensors: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    /// The `__metadata__` strings.
    pub metadata: BTreeMap<String, String>,
}

/// Reads a safetensors file of f32 tensors, checking every offset and shape
/// (a damaged or foreign file is an error, never a panic).
pub fn read_safetensors(path: &Path) -> Result<SafeTensors> {
    let bad = |why: String| Error::Checkpoint(format!("{}: {why}", path.display()));
    let mut f = fs::File::open(path).map_err(|e| io_err("cannot open", path, e))?;
    let size = f.metadata().map_err(|e| io_err("cannot stat", path, e))?.len();
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > size - 8 {
        return Err(bad(format!("a header of {n} bytes in a file of {size}")));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(|e| io_err("cannot read", path, e))?;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&h).map_err(|e| bad(format!("its header is not a JSON object: {e}")))?;
    let data_len = size - 8 - n;
    let mut out = SafeTensors::default();
    let mut spans = Vec::new();
    for (name, v) in &header {
        if name == "__metadata__" {
            let m = v
                .as_object()
                .ok_or_else(|| bad("__metadata__ is not an object".into()))?;
            for (k, v) in m {
                let s = v.as_str().ok_or_else(|| bad(format!("metadata {k} is not a string")))?;
                out.metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let dtype = v.get("dtype").and_then(Value::as_str);
        if dtype != Some("F32") {
            return Err(bad(format!(
                "tensor {name} has dtype {}; checkpoints hold F32",
                dtype.unwrap_or("(none)")
            )));
        }
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .ok_or_else(|| bad(format!("tensor {name} has no shape")))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .filter(|o: &Vec<u64>| o.len() == 2)
            .ok_or_else(|| bad(format!("tensor {name} has no data_offsets")))?;
        let numel = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
        if offs[0] > offs[1] || offs[1] > data_len || numel.and_then(|e| e.checked_mul(4)) != Some(offs[1] - offs[0]) {
            return Err(bad(format!(
                "tensor {name}: offsets {offs:?} and shape {shape:?} do not fit {data_len} data bytes"
            )));
        }
        spans.push((offs[0], offs[1], name.clone(), shape));
    }
    spans.sort();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(bad("tensors overlap".into()));
    }
    let mut pos = 0u64;
    let mut bytes = Vec::new();
    for (b, e, name, shape) in spans {
        if b > pos {
            std::io::copy(&mut (&mut f).take(b - pos), &mut std::io::sink())
                .map_err(|e| io_err("cannot read", path, e))?;
        }
        bytes.resize((e - b) as usize, 0);
        f.read_exact(&mut bytes).map_err(|e| io_err("cannot read", path, e))?;
        let vals = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.tensors.insert(name, (shape, vals));
        pos = e;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// The plan every rank derives the same way

/// What one job's checkpoints consist of: derived from the book the same way
/// on every rank.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) cfg: Checkpointing,
    pub(crate) run: String,
    pub(crate) rank: u32,
    /// Iterations done before this session (a resumed job's start).
    pub(crate) base: u64,
    /// This rank writes `model.safetensors` (worker 0).
    pub(crate) model_writer: bool,
    /// The file names a complete checkpoint has.
    pub(crate) files: Vec<String>,
    /// (name, shape) of every layer.
    pub(crate) layers: Vec<(String, [usize; 2])>,
}

impl Plan {
    pub(crate) fn new(cfg: Checkpointing, book: &Book, op: ApplyOp, rank: u32, run: String, base: u64) -> Self {
        let mut files = vec!["model.safetensors".to_string()];
        if op.needs_momentum() {
            for &s in book.cluster().servers() {
                if ps_chunks(book, s) > 0 {
                    files.push(format!("server-{s}.safetensors"));
                }
            }
        }
        if cfg.framework_state {
            files.push("framework.bin".into());
        }
        Plan {
            model_writer: book.cluster().worker_index(rank) == Some(0),
            layers: book.layers().iter().map(|l| (l.name.clone(), [l.m, l.n])).collect(),
            cfg,
            run,
            rank,
            base,
            files,
        }
    }
    /// The checkpoint (global iteration) that completing engine iteration
    /// `iter` makes, if it makes one.
    pub(crate) fn due(&self, iter: u64) -> Option<u64> {
        let k = self.base + iter + 1;
        (k % self.cfg.every == 0).then_some(k)
    }
    fn meta(&self, k: u64, kind: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("format".to_string(), FORMAT.to_string()),
            ("version".to_string(), VERSION.to_string()),
            ("iteration".to_string(), k.to_string()),
            ("run".to_string(), self.run.clone()),
            ("rank".to_string(), self.rank.to_string()),
            ("kind".to_string(), kind.to_string()),
        ])
    }
    fn manifest(&self, k: u64) -> Value {
        json!({
            "format": FORMAT,
            "version": VERSION,
            "iteration": k,
            "run": self.run,
            "every": self.cfg.every,
            "files": self.files,
            "layers": self.layers.iter().map(|(n, s)| json!({"name": n, "shape": s})).collect::<Vec<_>>(),
        })
    }
}

// ---------------------------------------------------------------------------
// The writer thread

enum WriteJob {
    Tensors {
        k: u64,
        file: String,
        kind: &'static str,
        tensors: Vec<Tensor>,
    },
    Blob {
        k: u64,
        bytes: Vec<u8>,
    },
}

/// A rank's checkpoint writer: a thread that writes what the runtime and the
/// executors snapshot, in order. Cloning shares it.
#[derive(Clone)]
pub(crate) struct Writer {
    plan: Arc<Plan>,
    inner: Arc<WriterInner>,
}

struct WriterInner {
    tx: Mutex<Option<Sender<WriteJob>>>,
    handle: Mutex<Option<JoinHandle<()>>>,
    errors: Arc<Mutex<Vec<String>>>,
    written: Arc<Mutex<Vec<u64>>>,
    counters: Arc<Counters>,
}

/// What a rank's checkpoints cost, for reports ([`crate::Session::checkpoint_stats`]).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    copy_ns: std::sync::atomic::AtomicU64,
    write_ns: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

/// What a rank's checkpoints cost so far.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointStats {
    /// Checkpoints this rank wrote its part of (global iterations).
    pub written: Vec<u64>,
    /// Seconds the training path spent copying snapshots (worker 0's
    /// runtime thread copying the model, a server's executor its momentum):
    /// the checkpoints' cost to the iterations.
    pub copy_s: f64,
    /// Seconds the checkpoint thread spent writing and syncing files (off
    /// the training path, but on the same machine).
    pub write_s: f64,
    /// Bytes written.
    pub bytes: u64,
    /// Why a checkpoint (or part of one) could not be written, each time.
    #[serde(default)]
    pub failed: Vec<String>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("plan", &self.plan)
            .finish_non_exhaustive()
    }
}

impl Writer {
    pub(crate) fn start(plan: Plan) -> Result<Self> {
        plan.cfg.validate()?;
        fs::create_dir_all(&plan.cfg.dir).map_err(|e| io_err("cannot create", &plan.cfg.dir, e))?;
        let plan = Arc::new(plan);
        // Two snapshots queued at most: a writer slower than the checkpoints
        // holds the next snapshot back (back-pressure) rather than piling up copies.
        let (tx, rx) = crossbeam_channel::bounded::<WriteJob>(2);
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let written: Arc<Mutex<Vec<u64>>> = Arc::default();
        let counters: Arc<Counters> = Arc::default();
        let (p, e, w, c) = (plan.clone(), errors.clone(), written.clone(), counters.clone());
        let handle = std::thread::Builder::new()
            .name(format!("tidewire-ckpt-{}", plan.rank))
            .spawn(move || write_loop(&p, &rx, &e, &w, &c))
            .map_err(|e| Error::Thread {
                what: "checkpoint writer",
                reason: e.to_string(),
            })?;
        Ok(Writer {
            plan,
            inner: Arc::new(WriterInner {
                tx: Mutex::new(Some(tx)),
                handle: Mutex::new(Some(handle)),
                errors,
                written,
                counters,
            }),
        })
    }
    pub(crate) fn plan(&self) -> &Plan {
        &self.plan
    }
    fn send(&self, job: WriteJob) {
        let tx = self.inner.tx.lock().unwrap_or_else(|p| p.into_inner());
        match tx.as_ref() {
            Some(tx) if tx.send(job).is_ok() => {}
            _ => self.fail("the checkpoint writer has stopped; a snapshot was dropped".into()),
        }
    }
    fn fail(&self, e: String) {
        tracing::error!(rank = self.plan.rank, "checkpoint: {e}");
        self.inner.errors.lock().unwrap_or_else(|p| p.into_inner()).push(e);
    }
    /// Worker 0's parameters (and its SFB layers' momentum) for checkpoint `k`.
    pub(crate) fn model(&self, k: u64, tensors: Vec<Tensor>) {
        self.send(WriteJob::Tensors {
            k,
            file: "model.safetensors".into(),
            kind: "model",
            tensors,
        });
    }
    /// A server's momentum pieces for checkpoint `k`.
    pub(crate) fn server(&self, k: u64, tensors: Vec<Tensor>) {
        self.send(WriteJob::Tensors {
            k,
            file: format!("server-{}.safetensors", self.plan.rank),
            kind: "server",
            tensors,
        });
    }
    /// The learner's framework state for checkpoint `k`.
    pub(crate) fn framework(&self, k: u64, bytes: Vec<u8>) -> Result<()> {
        if !self.plan.cfg.framework_state {
            return Err(Error::Checkpoint(
                "this job declared no framework state (Checkpointing::framework_state is false)".into(),
            ));
        }
        if k % self.plan.cfg.every != 0 || k <= self.plan.base {
            return Err(Error::Checkpoint(format!(
                "iteration {k} has no checkpoint: checkpoints are every {} iterations, after iteration {}",
                self.plan.cfg.every, self.plan.base
            )));
        }
        self.send(WriteJob::Blob { k, bytes });
        Ok(())
    }
    /// What this rank's checkpoints cost so far.
    pub(crate) fn stats(&self) -> CheckpointStats {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.inner.counters;
        CheckpointStats {
            failed: self.inner.errors.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            written: self.inner.written.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            copy_s: c.copy_ns.load(Relaxed) as f64 / 1e9,
            write_s: c.write_ns.load(Relaxed) as f64 / 1e9,
            bytes: c.bytes.load(Relaxed),
        }
    }
    /// Counts time a snapshot copy took on the training path.
    pub(crate) fn copied(&self, d: std::time::Duration) {
        self.inner
            .counters
            .copy_ns
            .fetch_add(d.as_nanos() as u64, std::sync::atomic::Ordering::Relaxed);
    }
    /// Writes what is queued and stops the thread. A checkpoint that could
    /// not be written was logged as an error and is counted
    /// ([`CheckpointStats::failed`]); it does not fail the training run
    /// (the older complete checkpoints remain).
    pub(crate) fn finish(&self) -> Result<()> {
        drop(self.inner.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(h) = self.inner.handle.lock().unwrap_or_else(|p| p.into_inner()).take() {
            if h.join().is_err() {
                self.fail("the checkpoint writer panicked".into());
            }
        }
        Ok(())
    }
}

fn write_loop(
    plan: &Plan,
    rx: &Receiver<WriteJob>,
    errors: &Mutex<Vec<String>>,
    written: &Mutex<Vec<u64>>,
    counters: &Counters,
) {
    use std::sync::atomic::Ordering::Relaxed;
    for job in rx {
        let t = std::time::Instant::now();
        let bytes = match &job {
            WriteJob::Tensors { tensors, .. } => tensors.iter().map(|t| t.data.len() as u64 * 4).sum(),
            WriteJob::Blob { bytes, .. } => bytes.len() as u64,
        };
        let (k, r) = match job {
            WriteJob::Tensors { k, file, kind, tensors } => (
                k,
                write_safetensors(&step_dir(&plan.cfg.dir, k).join(&file), &tensors, &plan.meta(k, kind)),
            ),
            WriteJob::Blob { k, bytes } => (
                k,
                write_atomic(&step_dir(&plan.cfg.dir, k).join("framework.bin"), |w| {
                    w.write_all(&bytes)?;
                    // The blob's run and iteration, beside it (a blob has no metadata of its own).
                    Ok(())
                })
                .and_then(|()| {
                    let m = plan.meta(k, "framework");
                    let j = serde_json::to_vec_pretty(&m).expect("a map serializes");
                    write_atomic(&step_dir(&plan.cfg.dir, k).join("framework.json"), |w| w.write_all(&j))
                }),
            ),
        };
        let r = r.and_then(|()| {
            let j = serde_json::to_vec_pretty(&plan.manifest(k)).expect("JSON serializes");
            write_atomic(&step_dir(&plan.cfg.dir, k).join("manifest.json"), |w| w.write_all(&j))
        });
        counters.write_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        match r {
            Ok(()) => {
                counters.bytes.fetch_add(bytes, Relaxed);
                let mut w = written.lock().unwrap_or_else(|p| p.into_inner());
                if !w.contains(&k) {
                    w.push(k);
                }
                drop(w);
                if plan.model_writer {
                    if let Err(e) = prune(&plan.cfg.dir, plan.cfg.keep) {
                        tracing::warn!(rank = plan.rank, "checkpoint: pruning: {e}");
                    }
                }
            }
            Err(e) => {
                tracing::error!(rank = plan.rank, "checkpoint {k}: {e}");
                errors
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(format!("checkpoint {k}: {e}"));
            }
        }
    }
}

/// The step directories under `dir`, oldest first.
fn steps(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io_err("cannot list", dir, e)),
    };
    for e in rd.flatten() {
        if let Some(k) = e.file_name().to_str().and_then(step_of) {
            if e.path().is_dir() {
                out.push((k, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Removes every step directory older than the `keep`-th newest complete
/// one. Its writers are done: each rank writes its checkpoints in order, and
/// a newer one is complete.
fn prune(dir: &Path, keep: usize) -> Result<()> {
    let all = steps(dir)?;
    let complete: Vec<u64> = all
        .iter()
        .filter(|(_, p)| completeness(p).is_ok())
        .map(|(k, _)| *k)
        .collect();
    let Some(&oldest_kept) = complete.get(complete.len().saturating_sub(keep)) else {
        return Ok(());
    };
    for (k, p) in all {
        if k < oldest_kept {
            fs::remove_dir_all(&p).map_err(|e| io_err("cannot remove", &p, e))?;
        }
    }
    Ok(())
}

/// Removes the step directories after iteration `k` (a resumed job redoes
/// them: files of the run that failed must not mix with the new run's).
pub fn remove_after(dir: &Path, k: u64) -> Result<Vec<u64>> {
    let mut gone = Vec::new();
    for (s, p) in steps(dir)? {
        if s > k {
            match fs::remove_dir_all(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err("cannot remove", &p, e)),
                _ => gone.push(s),
            }
        }
    }
    Ok(gone)
}

/// Why a step directory is not a complete checkpoint ([`completeness`]).
#[derive(Debug, thiserror::Error)]
enum Incomplete {
    /// The manifest cannot be read.
    #[error("no manifest.json")]
    NoManifest(#[source] std::io::Error),
    /// The manifest is not JSON.
    #[error("manifest.json: {0}")]
    ManifestJson(#[source] serde_json::Error),
    /// The manifest is of another format.
    #[error("manifest.json is not a Tidewire checkpoint's")]
    NotTidewire,
    /// The manifest lacks a field (`"iteration"`, `"run"`, `"files"`).
    #[error("manifest.json has no {0}")]
    ManifestLacks(&'static str),
    /// The manifest's file list holds something other than a string.
    #[error("manifest.json lists a file that is not a name")]
    FileNotAName,
    /// The manifest names a path outside the step directory.
    #[error("manifest.json lists {0:?}, which is not a file of this directory")]
    FileOutside(String),
    /// A file the manifest lists is not there.
    #[error("{0} is missing")]
    Missing(String),
    /// `framework.bin`'s metadata cannot be read.
    #[error("framework.json is missing")]
    NoFrameworkJson(#[source] std::io::Error),
    /// `framework.bin`'s metadata is not a JSON map of strings.
    #[error("framework.json: {0}")]
    FrameworkJson(#[source] serde_json::Error),
    /// A safetensors file cannot be opened.
    #[error("{}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file's size or header cannot be read.
    #[error("{0}")]
    Read(#[source] std::io::Error),
    /// A safetensors file shorter than its header's length.
    #[error("{} is truncated", path.display())]
    Truncated {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A safetensors header length past the bound or the file.
    #[error("{} has a damaged header", path.display())]
    DamagedHeader { path: PathBuf },
    /// A safetensors header that is not JSON.
    #[error("{}: {source}", path.display())]
    HeaderJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file cut short in its data (or with bytes past it).
    #[error("{} is {size} bytes, but its header describes {described}", path.display())]
    Size { path: PathBuf, size: u64, described: u64 },
    /// A file of another iteration or run than the manifest's.
    #[error(
        "{file} is of iteration {iteration:?} of run {run:?}, not of iteration {want_iteration} of run {want_run}"
    )]
    OtherRun {
        file: String,
        iteration: Option<String>,
        run: Option<String>,
        want_iteration: u64,
        want_run: String,
    },
}

/// Why the checkpoint in `step` is not complete, or its manifest.
fn completeness(step: &Path) -> std::result::Result<Value, Incomplete> {
    let m = fs::read(step.join("manifest.json")).map_err(Incomplete::NoManifest)?;
    let m: Value = serde_json::from_slice(&m).map_err(Incomplete::ManifestJson)?;
    if m.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(Incomplete::NotTidewire);
    }
    let k = m
        .get("iteration")
        .and_then(Value::as_u64)
        .ok_or(Incomplete::ManifestLacks("iteration"))?;
    let run = m
        .get("run")
        .and_then(Value::as_str)
        .ok_or(Incomplete::ManifestLacks("run"))?;
    let files = m
        .get("files")
        .and_then(Value::as_array)
        .ok_or(Incomplete::ManifestLacks("files"))?;
    for f in files {
        let f = f.as_str().ok_or(Incomplete::FileNotAName)?;
        if f.contains('/') || f.starts_with('.') {
            return Err(Incomplete::FileOutside(f.to_string()));
        }
        let p = step.join(f);
        if !p.is_file() {
            return Err(Incomplete::Missing(f.to_string()));
        }
        let meta: BTreeMap<String, String> = if f == "framework.bin" {
            let j = fs::read(step.join("framework.json")).map_err(Incomplete::NoFrameworkJson)?;
            serde_json::from_slice(&j).map_err(Incomplete::FrameworkJson)?
        } else {
            safetensors_metadata(&p)?
        };
        if meta.get("iteration").map(String::as_str) != Some(&k.to_string())
            || meta.get("run").map(String::as_str) != Some(run)
        {
            return Err(Incomplete::OtherRun {
                file: f.to_string(),
                iteration: meta.get("iteration").cloned(),
                run: meta.get("run").cloned(),
                want_iteration: k,
                want_run: run.to_string(),
            });
        }
    }
    Ok(m)
}

/// A safetensors file's metadata, without reading its data.
fn safetensors_metadata(p: &Path) -> std::result::Result<BTreeMap<String, String>, Incomplete> {
    let path = || p.to_path_buf();
    let mut f = fs::File::open(p).map_err(|source| Incomplete::Open { path: path(), source })?;
    let size = f.metadata().map_err(Incomplete::Read)?.len();
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8)
        .map_err(|source| Incomplete::Truncated { path: path(), source })?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > size.saturating_sub(8) {
        return Err(Incomplete::DamagedHeader { path: path() });
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h).map_err(Incomplete::Read)?;
    let v: Value = serde_json::from_slice(&h).map_err(|source| Incomplete::HeaderJson { path: path(), source })?;
    // A file cut short in its data is not whole: its size is the header's and the data's.
    let end = v
        .as_object()
        .map(|o| {
            o.values()
                .filter_map(|t| t.get("data_offsets")?.as_array()?.get(1)?.as_u64())
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    if size != 8 + n + end {
        return Err(Incomplete::Size {
            path: path(),
            size,
            described: 8 + n + end,
        });
    }
    Ok(v.get("__metadata__")
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default())
}

// ---------------------------------------------------------------------------
// Loading

/// A complete checkpoint, read back for a resume.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// Its directory.
    pub dir: PathBuf,
    /// Iterations done: the resumed job's first iteration.
    pub iteration: u64,
    /// Every layer's parameters, in the book's order.
    pub params: Vec<Vec<f32>>,
    /// Every layer's momentum, where the checkpoint has it.
    pub momentum: Vec<Option<Vec<f32>>>,
    /// The learner's framework state, where the job saved one.
    pub framework: Option<Vec<u8>>,
}

impl Loaded {
    /// The newest complete checkpoint under `dir` (a directory of `step-*`
    /// directories), if there is one.
    pub fn newest_complete(dir: impl AsRef<Path>) -> Result<Option<PathBuf>> {
        Ok(steps(dir.as_ref())?
            .into_iter()
            .rev()
            .find(|(_, p)| completeness(p).is_ok())
            .map(|(_, p)| p))
    }

    /// Opens `path`: a step directory, or a directory of them (then the
    /// newest complete one), and checks it against `book`'s layers.
    pub fn open(path: impl AsRef<Path>, book: &Book) -> Result<Self> {
        let path = path.as_ref();
        let step = if path.join("manifest.json").is_file() {
            path.to_path_buf()
        } else {
            Self::newest_complete(path)?.ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{} holds no complete checkpoint to resume from",
                    path.display()
                ))
            })?
        };
        let m = completeness(&step)
            .map_err(|why| Error::Checkpoint(format!("{} is not a complete checkpoint: {why}", step.display())))?;
        let iteration = m["iteration"].as_u64().expect("checked");
        let files: Vec<&str> = m["files"]
            .as_array()
            .expect("checked")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let model = read_safetensors(&step.join("model.safetensors"))?;
        let nl = book.layers().len();
        let mut params = Vec::with_capacity(nl);
        let mut momentum: Vec<Option<Vec<f32>>> = vec![None; nl];
        let mut pieces: Vec<Vec<(usize, Vec<f32>)>> = vec![Vec::new(); nl];
        let index: BTreeMap<&str, usize> = book
            .layers()
            .iter()
            .enumerate()
            .map(|(i, l)| (l.name.as_str(), i))
            .collect();
        for (i, l) in book.layers().iter().enumerate() {
            let (shape, v) = model.tensors.get(&l.name).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "{}: no parameters for layer {} ({}): the checkpoint is of another model",
                    step.display(),
                    i,
                    l.name
                ))
            })?;
            if shape != &[l.m, l.n] {
                return Err(Error::Checkpoint(format!(
                    "{}: layer {} has shape {shape:?} in the checkpoint and [{}, {}] in this job",
                    step.display(),
                    l.name,
                    l.m,
                    l.n
                )));
            }
            params.push(v.clone());
            if let Some((_, mv)) = model.tensors.get(&format!("momentum/{}", l.name)) {
                if mv.len() != l.params() {
                    return Err(Error::Checkpoint(format!(
                        "momentum of {} has {} values",
                        l.name,
                        mv.len()
                    )));
                }
                momentum[i] = Some(mv.clone());
            }
        }
        for f in files.iter().filter(|f| f.starts_with("server-")) {
            let s = read_safetensors(&step.join(f))?;
            for (name, (_, v)) in s.tensors {
                let bad = || Error::Checkpoint(format!("{f}: a tensor named {name:?} is no momentum piece"));
                let rest = name.strip_prefix("momentum/").ok_or_else(bad)?;
                let (layer, off) = rest.rsplit_once('/').ok_or_else(bad)?;
                let off: usize = off.parse().map_err(|_| bad())?;
                let &l = index.get(layer).ok_or_else(|| {
                    Error::Checkpoint(format!(
                        "{f}: momentum of layer {layer:?}, which this job does not have"
                    ))
                })?;
                pieces[l].push((off, v));
            }
        }
        for (l, mut ps) in pieces.into_iter().enumerate() {
            if ps.is_empty() {
                continue;
            }
            let spec = &book.layers()[l];
            ps.sort_by_key(|p| p.0);
            let mut full = vec![0f32; spec.params()];
            let mut at = 0;
            for (off, v) in ps {
                if off != at || off + v.len() > full.len() {
                    return Err(Error::Checkpoint(format!(
                        "{}: the momentum pieces of {} do not tile it (a piece at {off}, expected {at})",
                        step.display(),
                        spec.name
                    )));
                }
                full[off..off + v.len()].copy_from_slice(&v);
                at = off + v.len();
            }
            if at != full.len() || momentum[l].is_some() {
                return Err(Error::Checkpoint(format!(
                    "{}: the momentum of {} is incomplete or given twice",
                    step.display(),
                    spec.name
                )));
            }
            momentum[l] = Some(full);
        }
        let framework = if files.contains(&"framework.bin") {
            Some(
                fs::read(step.join("framework.bin"))
                    .map_err(|e| io_err("cannot read", &step.join("framework.bin"), e))?,
            )
        } else {
            None
        };
        Ok(Loaded {
            dir: step,
            iteration,
            params,
            momentum,
            framework,
        })
    }

    /// Checks that this checkpoint can resume a job with `op` on `book`: an
    /// op that keeps momentum needs every layer's.
    pub(crate) fn check_op(&self, book: &Book, op: ApplyOp) -> Result<()> {
        if !op.needs_momentum() {
            return Ok(());
        }
        for (i, l) in book.layers().iter().enumerate() {
            if self.momentum[i].is_none() {
                let how = if book.scheme(i as u32, 0) == Scheme::Sfb {
                    "SFB"
                } else {
                    "PS"
                };
                return Err(Error::Checkpoint(format!(
                    "{} has no momentum for layer {} ({how}), but this job's op keeps momentum: the checkpoint was saved with an op without momentum, or its files hold none for it",
                    self.dir.display(),
                    l.name
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_book() -> Book {
        use tidewire_engine::book::{BookConfig, LayerKind, LayerSpec};
        let layers = vec![
            LayerSpec::new("conv", LayerKind::Conv, 64, 27),
            LayerSpec::new("fc", LayerKind::Fc, 10, 64),
        ];
        Book::new(
            tidewire_engine::Cluster::split(2, 1).unwrap(),
            layers,
            BookConfig::default(),
        )
        .unwrap()
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tidewire-ckpt-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn safetensors_round_trips_and_refuses_damage() {
        let d = tmpdir("st");
        let p = d.join("a.safetensors");
        let t = vec![
            Tensor {
                name: "w".into(),
                shape: vec![2, 3],
                data: vec![1.0, -2.0, 3.5, f32::MIN_POSITIVE, 0.0, -0.0],
            },
            Tensor {
                name: "momentum/w/0".into(),
                shape: vec![0],
                data: vec![],
            },
        ];
        let meta = BTreeMap::from([("iteration".to_string(), "4".to_string())]);
        write_safetensors(&p, &t, &meta).unwrap();
        let back = read_safetensors(&p).unwrap();
        assert_eq!(back.metadata, meta);
        let (shape, v) = &back.tensors["w"];
        assert_eq!(shape, &vec![2, 3]);
        assert_eq!(
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            t[0].data.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(back.tensors["momentum/w/0"].1.len(), 0);
        // Every truncation is an error, not a panic.
        let bytes = fs::read(&p).unwrap();
        for cut in [0, 4, 8, 9, bytes.len() - 1] {
            fs::write(&p, &bytes[..cut]).unwrap();
            assert!(read_safetensors(&p).is_err(), "a file cut at {cut} was read");
        }
        // A wrong shape for the offsets is refused (the header edited in place).
        let mut bad = bytes.clone();
        let at = bad
            .windows(5)
            .position(|w| w == b"[2,3]")
            .expect("the shape in the header");
        bad[at + 1] = b'3';
        fs::write(&p, &bad).unwrap();
        let why = read_safetensors(&p).unwrap_err().to_string();
        assert!(why.contains("do not fit"), "{why}");
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn due_counts_from_the_resumed_iteration() {
        let book = small_book();
        let mut p = Plan::new(
            Checkpointing::new("/nonexistent", 4),
            &book,
            ApplyOp::Mean,
            0,
            "r".into(),
            0,
        );
        let due: Vec<u64> = (0..12).filter_map(|i| p.due(i)).collect();
        assert_eq!(due, vec![4, 8, 12]);
        p.base = 4;
        let due: Vec<u64> = (0..8).filter_map(|i| p.due(i)).collect();
        assert_eq!(due, vec![8, 12]);
    }

    #[test]
    fn completeness_needs_every_file_of_one_run() {
        let d = tmpdir("complete");
        let book = small_book();
        let op = ApplyOp::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let plan = Plan::new(Checkpointing::new(&d, 2), &book, op, 0, "run-a".into(), 0);
        assert!(plan.files.len() >= 2, "{:?}", plan.files);
        let step = step_dir(&d, 2);
        let write = |file: &str, run: &str| {
            let mut p = plan.clone();
            p.run = run.into();
            write_safetensors(&step.join(file), &[], &p.meta(2, "x")).unwrap();
            let j = serde_json::to_vec(&plan.manifest(2)).unwrap();
            write_atomic(&step.join("manifest.json"), |w| w.write_all(&j)).unwrap();
        };
        write("model.safetensors", "run-a");
        assert!(completeness(&step).is_err());
        for f in plan.files.iter().skip(1) {
            write(f, "run-b");
        }
        let why = completeness(&step).unwrap_err();
        assert!(matches!(why, Incomplete::OtherRun { .. }), "{why}");
        assert!(why.to_string().contains("run"), "{why}");
        for f in plan.files.iter().skip(1) {
            write(f, "run-a");
        }
        completeness(&step).unwrap();
        assert_eq!(Loaded::newest_complete(&d).unwrap(), Some(step.clone()));
        assert_eq!(remove_after(&d, 0).unwrap(), vec![2]);
        assert_eq!(Loaded::newest_complete(&d).unwrap(), None);
        let _ = fs::remove_dir_all(&d);
    }
}
