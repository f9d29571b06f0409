//! Who is in the job: the cluster description, from explicit settings or from
//! the environment of the launchers people already use.
//!
//! | variable | meaning |
//! |---|---|
//! | `TIDEWIRE_RANK`, `TIDEWIRE_WORLD_SIZE`, `TIDEWIRE_MASTER` (`host:port`) | Tidewire's own |
//! | `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` | torchrun |
//! | `SLURM_PROCID`, `SLURM_NTASKS` | Slurm (master from `TIDEWIRE_MASTER` or `MASTER_ADDR`/`MASTER_PORT`) |
//! | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | Open MPI (same master rule) |
//! | `TIDEWIRE_SERVERS` | the last N ranks are servers only; unset: every rank is worker and server |
//! | `TIDEWIRE_SECRET` | the job secret peers authenticate with (any string, same on every rank) |
//! | `TIDEWIRE_JOB` | job id (a number; default 1) |
//!
//! Tidewire's own variables win over torchrun's, which win over Slurm's, then Open MPI's.

use std::net::{SocketAddr, ToSocketAddrs};

use tidewire_engine::{Cluster, Role};

use crate::error::{Error, Result};

/// One rank's view of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// This process's rank.
    pub rank: u32,
    /// Roles of every rank.
    pub roles: Vec<Role>,
    /// Rank 0's rendezvous address.
    pub master: SocketAddr,
    /// Which launcher the values came from (for messages).
    pub source: &'static str,
}

impl ClusterSpec {
    /// `workers` worker ranks then `servers` server ranks (or `colocate`: every
    /// rank both, with `workers` ranks).
    pub fn new(rank: u32, workers: usize, servers: usize, colocate: bool, master: SocketAddr) -> Result<Self> {
        let roles = if colocate {
            vec![Role::Both; workers]
        } else {
            let mut r = vec![Role::Worker; workers];
            r.extend(std::iter::repeat(Role::Server).take(servers));
            r
        };
        if rank as usize >= roles.len() {
            return Err(Error::Cluster(format!(
                "rank {rank} outside a world of {}",
                roles.len()
            )));
        }
        Cluster::from_roles(roles.clone())?;
        Ok(ClusterSpec {
            rank,
            roles,
            master,
            source: "explicit",
        })
    }

    /// Reads the environment (see the module docs).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Like [`ClusterSpec::from_env`], from any lookup (for tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let launchers: [(&'static str, &str, &str); 4] = [
            ("tidewire", "TIDEWIRE_RANK", "TIDEWIRE_WORLD_SIZE"),
            ("torchrun", "RANK", "WORLD_SIZE"),
            ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
            ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ];
        let (source, rank, world) = launchers
            .iter()
            .find_map(|(src, r, w)| Some((*src, get(r)?, get(w).unwrap_or_default(), *r, *w)))
            .map(|(src, r, w, rn, wn)| -> Result<_> {
                let rank: u32 = r.trim().parse().map_err(|_| Error::Cluster(format!("{rn}={r:?} is not a number")))?;
                let world: usize = w
                    .trim()
                    .parse()
                    .map_err(|_| Error::Cluster(format!("{wn}={w:?} is not a number (it must be set with {rn})")))?;
                Ok((src, rank, world))
            })
            .transpose()?
            .ok_or_else(|| {
                Error::Cluster(
                    "no rank in the environment: set TIDEWIRE_RANK and TIDEWIRE_WORLD_SIZE, or run under torchrun, Slurm or mpirun"
                        .into(),
                )
            })?;
        let master = match (get("TIDEWIRE_MASTER"), get("MASTER_ADDR"), get("MASTER_PORT")) {
            (Some(m), _, _) => m,
            (None, Some(a), Some(p)) => format!("{a}:{p}"),
            _ => {
                return Err(Error::Cluster(
                    "no rendezvous address: set TIDEWIRE_MASTER=host:port, or MASTER_ADDR and MASTER_PORT".into(),
                ))
            }
        };
        let master = master
            .to_socket_addrs()
            .map_err(|e| Error::Cluster(format!("rendezvous address {master:?}: {e}")))?
            .next()
            .ok_or_else(|| Error::Cluster(format!("rendezvous address {master:?} resolves to nothing")))?;
        let servers = match get("TIDEWIRE_SERVERS") {
            None => None,
            Some(s) => Some(
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| Error::Cluster(format!("TIDEWIRE_SERVERS={s:?} is not a number")))?,
            ),
        };
        let mut spec = match servers {
            None | Some(0) => Self::new(rank, world, 0, true, master)?,
            Some(s) if s >= world => {
                return Err(Error::Cluster(format!(
                    "TIDEWIRE_SERVERS={s} leaves no worker in a world of {world}"
                )))
            }
            Some(s) => Self::new(rank, world - s, s, false, master)?,
        };
        spec.source = source;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(kv: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn torchrun_variables() {
        let s = ClusterSpec::from_vars(vars(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap();
        assert_eq!((s.rank, s.roles.len(), s.source), (2, 4, "torchrun"));
        assert!(s.roles.iter().all(|r| *r == Role::Both));
        assert_eq!(s.master.port(), 29500);
    }

    #[test]
    fn slurm_and_mpi_with_separate_servers() {
        let s = ClusterSpec::from_vars(vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("TIDEWIRE_MASTER", "127.0.0.1:7000"),
            ("TIDEWIRE_SERVERS", "2"),
        ]))
        .unwrap();
        assert_eq!(s.source, "slurm");
        assert_eq!(s.roles[5], Role::Server);
        assert_eq!(s.roles[3], Role::Worker);
        let m = ClusterSpec::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("TIDEWIRE_MASTER", "127.0.0.1:7000"),
        ]))
        .unwrap();
        assert_eq!(m.source, "openmpi");
    }

    #[test]
    fn tidewire_variables_win() {
        let s = ClusterSpec::from_vars(vars(&[
            ("TIDEWIRE_RANK", "1"),
            ("TIDEWIRE_WORLD_SIZE", "2"),
            ("RANK", "0"),
            ("WORLD_SIZE", "9"),
            ("TIDEWIRE_MASTER", "127.0.0.1:7000"),
        ]))
        .unwrap();
        assert_eq!((s.rank, s.roles.len(), s.source), (1, 2, "tidewire"));
    }

    #[test]
    fn bad_environments_are_typed_errors() {
        for kv in [
            vec![],
            vec![("RANK", "x"), ("WORLD_SIZE", "2"), ("TIDEWIRE_MASTER", "127.0.0.1:1")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2")],
            vec![("RANK", "3"), ("WORLD_SIZE", "2"), ("TIDEWIRE_MASTER", "127.0.0.1:1")],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("TIDEWIRE_MASTER", "127.0.0.1:1"),
                ("TIDEWIRE_SERVERS", "2"),
            ],
        ] {
            assert!(
                matches!(ClusterSpec::from_vars(vars(&kv)), Err(Error::Cluster(_))),
                "{kv:?}"
            );
        }
    }
}
