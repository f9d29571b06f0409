//! Jobs on a host's shared cores ([`SimConfig::host_cpu`]): each executor
//! runs its queue one job at a time, and a running job progresses at the
//! share of a core the host gives each of its consumers ([`Net::cpu_speed`]),
//! which changes as loopback connections and other executors come and go.
//! Every change brings each running job's work up to now at the old share
//! and schedules its end again at the new one (a fluid model).
//!
//! [`SimConfig::host_cpu`]: crate::SimConfig::host_cpu
//! [`Net::cpu_speed`]: crate::net::Net::cpu_speed

use tidewire_engine::node::Input;

use crate::config::SimError;
use crate::exec::job_ns;
use crate::rank::Running;
use crate::world::{Ev, Sim};

impl Sim {
    /// Starts executor `q` of rank `r` on its next job, if it is idle and one waits.
    pub(crate) fn cpu_start(&mut self, r: u32, q: usize) {
        let exec = &mut self.ranks[r as usize].cpu[q];
        if exec.running.is_some() {
            return;
        }
        let Some(job) = exec.waiting.pop_front() else {
            return;
        };
        let left = job_ns(&self.cfg, &job) as f64;
        exec.running = Some(Running {
            job,
            left,
            since: self.now,
            speed: 0.0,
        });
        let host = self.net.host_of(r);
        let jobs = self.net.jobs(host) + 1;
        self.net.set_jobs(host, jobs, self.now);
        self.cpu_refresh();
    }

    /// Executor `q` of rank `r` reaches the end scheduled as `gen`.
    pub(crate) fn cpu_done(&mut self, r: u32, q: usize, gen: u64) -> Result<(), SimError> {
        let exec = &mut self.ranks[r as usize].cpu[q];
        if exec.gen != gen {
            return Ok(());
        }
        let Some(run) = exec.running.take() else {
            debug_assert!(false, "rank {r} executor {q}: an end scheduled as {gen} without a job");
            return Ok(());
        };
        let job = run.job;
        let host = self.net.host_of(r);
        let jobs = self.net.jobs(host).saturating_sub(1);
        self.net.set_jobs(host, jobs, self.now);
        if self.dead(r) {
            // A dead process runs nothing more.
            self.ranks[r as usize].cpu[q].waiting.clear();
            self.cpu_refresh();
            return Ok(());
        }
        self.cpu_start(r, q);
        self.cpu_refresh();
        let done = self.ranks[r as usize].store.execute(&self.cfg, r, &job);
        let data = done.map_err(|what| self.violation(what))?;
        self.feed(r, Input::JobDone { id: job.id, data })
    }

    /// Rank `r` dies (or is replaced by a new process): its executors drop
    /// their queues and running jobs, give their cores back, and every end
    /// scheduled for them goes stale. Returns the generations, which a new
    /// process of the rank carries on from.
    pub(crate) fn cpu_kill(&mut self, r: u32) -> [u64; 2] {
        let mut freed = 0;
        for exec in &mut self.ranks[r as usize].cpu {
            exec.waiting.clear();
            freed += u32::from(exec.running.take().is_some());
            exec.gen += 1;
        }
        if freed > 0 {
            let host = self.net.host_of(r);
            let jobs = self.net.jobs(host).saturating_sub(freed);
            self.net.set_jobs(host, jobs, self.now);
            self.cpu_refresh();
        }
        let c = &self.ranks[r as usize].cpu;
        [c[0].gen, c[1].gen]
    }

    /// Brings every running job whose host's share changed up to now, and
    /// schedules its end again at the new share.
    pub(crate) fn cpu_refresh(&mut self) {
        if !self.net.has_host_cpu() {
            return;
        }
        let now = self.now;
        for r in 0..self.ranks.len() {
            let speed = self.net.cpu_speed(self.net.host_of(r as u32));
            for q in 0..2 {
                let exec = &mut self.ranks[r].cpu[q];
                let Some(run) = exec.running.as_mut().filter(|x| x.speed != speed) else {
                    continue;
                };
                run.left = (run.left - (now - run.since) as f64 * run.speed).max(0.0);
                run.since = now;
                run.speed = speed;
                exec.gen += 1;
                let end = now + (run.left / speed).ceil() as u64;
                let gen = exec.gen;
                self.at(end, Ev::CpuDone(r as u32, q, gen));
            }
        }
    }
}
