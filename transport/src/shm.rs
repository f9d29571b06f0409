//! Memory shared by the processes of one node: a file in `/dev/shm` (or any
//! path) mapped `MAP_SHARED` by every process that opens it. Nexus's local
//! aggregator keeps its learners' gradient slots, the parameter cache and the
//! handshake words here.
//!
//! Every other process may write any part of it at any time, so it is never
//! handed out as a plain slice: it is viewed as atomics only ([`SharedMem::words`]
//! for the control words, [`SharedMem::data`] for f32 bits), and the protocol
//! on top orders the accesses with acquire/release on the words.
//!
//! ```
//! use std::sync::atomic::Ordering;
//! use tidewire_transport::shm::SharedMem;
//! let dir = std::env::temp_dir().join(format!("tw-shm-doc-{}", std::process::id()));
//! let a = SharedMem::create(&dir, 4, 16).unwrap();
//! let b = SharedMem::open(&dir, 4, 16).unwrap();
//! a.words()[0].store(7, Ordering::Release);
//! a.data()[3].store(1.5f32.to_bits(), Ordering::Relaxed);
//! assert_eq!(b.words()[0].load(Ordering::Acquire), 7);
//! assert_eq!(f32::from_bits(b.data()[3].load(Ordering::Relaxed)), 1.5);
//! std::fs::remove_file(&dir).unwrap();
//! ```

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};

/// A shared mapping: `words` control words (u64) followed by `floats` f32 cells.
pub struct SharedMem {
    map: MmapRaw,
    words: usize,
    floats: usize,
    path: PathBuf,
}

impl std::fmt::Debug for SharedMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMem")
            .field("path", &self.path)
            .field("words", &self.words)
            .field("floats", &self.floats)
            .finish()
    }
}

fn bytes_of(words: usize, floats: usize) -> io::Result<usize> {
    words
        .checked_mul(8)
        .and_then(|w| floats.checked_mul(4).and_then(|f| w.checked_add(f)))
        .filter(|&n| n > 0 && n <= isize::MAX as usize)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "shared memory size out of range"))
}

impl SharedMem {
    /// Creates (or truncates and re-creates) the file at `path`, zero-filled,
    /// and maps it. The file is written under a temporary name and renamed
    /// into place, so a process that opens `path` sees either the old file or
    /// the whole new one: callers put a run nonce in a word to tell them apart.
    pub fn create(path: &Path, words: usize, floats: usize) -> io::Result<Self> {
        let len = bytes_of(words, floats)?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        file.set_len(len as u64)?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        std::fs::rename(&tmp, path)?;
        Ok(SharedMem {
            map,
            words,
            floats,
            path: path.to_path_buf(),
        })
    }

    /// Maps an existing file of exactly this shape.
    pub fn open(path: &Path, words: usize, floats: usize) -> io::Result<Self> {
        let len = bytes_of(words, floats)?;
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let have = file.metadata()?.len();
        if have != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} holds {have} bytes, not the {len} this layout needs (another job's file?)",
                    path.display()
                ),
            ));
        }
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        Ok(SharedMem {
            map,
            words,
            floats,
            path: path.to_path_buf(),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The control words.
    pub fn words(&self) -> &[AtomicU64] {
        // The mapping is `words * 8 + floats * 4` bytes, page aligned, and
        // lives as long as `self`; other processes write it at any time.
        // SAFETY: 8-aligned, in bounds and alive; AtomicU64 is u64-sized and
        // is the sound view of memory others mutate.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr() as *const AtomicU64, self.words) }
    }

    /// The f32 cells, as their bits.
    pub fn data(&self) -> &[AtomicU32] {
        // SAFETY: the cells start right after the words (4-aligned) and end at
        // the mapping's end; atomics are the sound view of shared writes.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.words * 8) as *const AtomicU32, self.floats) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn two_mappings_see_each_other_and_shapes_are_checked() {
        let p = std::env::temp_dir().join(format!("tw-shm-test-{}", std::process::id()));
        let a = SharedMem::create(&p, 3, 5).unwrap();
        let b = SharedMem::open(&p, 3, 5).unwrap();
        b.data()[4].store(2.25f32.to_bits(), Ordering::Relaxed);
        b.words()[2].store(9, Ordering::Release);
        assert_eq!(a.words()[2].load(Ordering::Acquire), 9);
        assert_eq!(f32::from_bits(a.data()[4].load(Ordering::Relaxed)), 2.25);
        let e = SharedMem::open(&p, 3, 6).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(SharedMem::create(&p, 0, 0).is_err());
        // Re-creating gives a fresh zeroed file; the old mapping keeps the old one.
        let c = SharedMem::create(&p, 3, 5).unwrap();
        assert_eq!(c.words()[2].load(Ordering::Acquire), 0);
        assert_eq!(a.words()[2].load(Ordering::Acquire), 9);
        std::fs::remove_file(&p).unwrap();
    }
}
