//! Process groups: joining a job through the rendezvous store, the mesh of peer links, and
//! collectives run in FIFO order on a per-group communication thread, returned as
//! [`Work`] handles so callers overlap communication with compute.

use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::options::GroupOptions;
use crate::protocol::{Engine, Net};
use crate::rendezvous::{BlocksRendezvous, connect_mesh, setup_shared_blocks, setup_shm};
use crate::shm::{Segment, SharedBlocks};
use crate::store::{StoreClient, StoreServer};
use crate::transport::{Inbox, Links};
use crate::work::Work;
use crate::world::WorldInfo;

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// Ranks of a job (or of a subset of it) that run collectives together.
pub struct ProcessGroup {
    rank: usize,
    size: usize,
    global_ranks: Vec<usize>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    store: Option<Arc<StoreClient>>,
    server: Option<Arc<StoreServer>>,
    options: GroupOptions,
    data_ip: String,
    name: String,
    subgroups: AtomicU64,
    joins: AtomicU64,
    transport: &'static str,
    bytes_sent: Arc<AtomicU64>,
    /// The shared-memory segment and the links' inbox (peers lost), where data goes through
    /// shared memory: what [`ProcessGroup::shared_blocks`] waits with.
    shm: Option<(Arc<Segment>, Arc<Inbox>)>,
    /// `shared_blocks` calls so far (each one's store keys).
    blocks_made: AtomicU64,
}

impl ProcessGroup {
    /// Joins the job described by this process's environment (see [`WorldInfo::from_env`]).
    pub fn from_env() -> Result<ProcessGroup> {
        let world = WorldInfo::from_env().map_err(|e| CommError::InvalidArgument {
            rank: 0,
            op: "process group initialisation".into(),
            reason: e.to_string(),
        })?;
        ProcessGroup::init(&world, GroupOptions::from_env()?)
    }

    /// Joins the job: rank 0 hosts the store at `MASTER_ADDR:MASTER_PORT`, every rank
    /// registers, and the ranks connect to each other.
    pub fn init(world: &WorldInfo, options: GroupOptions) -> Result<ProcessGroup> {
        let rank = world.rank;
        let io = |what: &str, e: std::io::Error| CommError::Io {
            rank,
            what: what.to_string(),
            message: e.to_string(),
        };
        if world.world_size == 1 {
            return ProcessGroup::start(
                0,
                vec![0],
                None,
                None,
                options,
                world.master_addr.clone(),
                "world".into(),
                Vec::new(),
                None,
            );
        }
        let server = if rank == 0 && options.host_store {
            let addr = (world.master_addr.as_str(), world.master_port);
            let server = StoreServer::bind(addr, &options.secret).map_err(|e| {
                io(
                    &format!(
                        "starting the rendezvous store on {}:{}",
                        world.master_addr, world.master_port
                    ),
                    e,
                )
            })?;
            Some(Arc::new(server))
        } else {
            None
        };
        let store = Arc::new(StoreClient::connect(
            &world.master_addr,
            world.master_port,
            &options.secret,
            rank,
            options.rendezvous_timeout,
        )?);
        let members: Vec<usize> = (0..world.world_size).collect();
        let name = format!("{}world", options.store_prefix);
        // This host's own address for peers (MASTER_ADDR is machine 0's).
        let listen = crate::address::listen_address(&world.master_addr, world.master_port)
            .map_err(|reason| CommError::InvalidArgument {
                rank,
                op: "choosing the address to listen on for peers".into(),
                reason,
            })?;
        let data_ip = listen.ip.to_string();
        let streams = connect_mesh(&store, &name, rank, &members, &data_ip, &options)?;
        let shm = setup_shm(&store, &name, rank, &members, &options)?;
        ProcessGroup::start(
            rank,
            members,
            Some(store),
            server,
            options,
            data_ip,
            name,
            streams,
            shm,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        rank: usize,
        global_ranks: Vec<usize>,
        store: Option<Arc<StoreClient>>,
        server: Option<Arc<StoreServer>>,
        options: GroupOptions,
        data_ip: String,
        name: String,
        streams: Vec<Option<TcpStream>>,
        shm: Option<Arc<Segment>>,
    ) -> Result<ProcessGroup> {
        let size = global_ranks.len();
        let global_rank = global_ranks[rank];
        // A single-rank group has no peers: its links are empty.
        let streams = if size > 1 { streams } else { vec![None] };
        let links = Links::start(streams, &format!("fsdp-{name}")).map_err(|e| CommError::Io {
            rank: global_rank,
            what: "starting peer links".into(),
            message: e.to_string(),
        })?;
        let shared = shm.clone().map(|seg| (seg, links.inbox.clone()));
        let net = match shm {
            Some(seg) => {
                let waker_seg = seg.clone();
                links
                    .inbox
                    .set_waker(Box::new(move || waker_seg.ring_doorbell(rank)));
                Net::Shm { seg, links }
            }
            None => Net::Tcp(links),
        };
        let transport = net.kind();
        let (tx, rx) = mpsc::channel::<Job>();
        let mut engine = Engine::new(rank, global_ranks.clone(), net, options.timeout);
        let bytes_sent = engine.bytes_sent();
        let thread = std::thread::Builder::new()
            .name(format!("fsdp-comm-{name}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job(&mut engine);
                }
            })
            .map_err(|e| CommError::Io {
                rank: global_rank,
                what: "starting the communication thread".into(),
                message: e.to_string(),
            })?;
        Ok(ProcessGroup {
            rank,
            size,
            global_ranks,
            jobs: Mutex::new(Some(tx)),
            thread: Some(thread),
            store,
            server,
            options,
            data_ip,
            name,
            subgroups: AtomicU64::new(0),
            joins: AtomicU64::new(0),
            transport,
            bytes_sent,
            shm: shared,
            blocks_made: AtomicU64::new(0),
        })
    }

    /// Payload bytes this rank has sent in this group's collectives so far (headers and
    /// rendezvous excluded): the figure to compare with an algorithm's theoretical traffic.
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent.load(Ordering::Relaxed)
    }

    /// The transport carrying this group's data: `"tcp"` or `"shm"`.
    pub fn transport(&self) -> &'static str {
        self.transport
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The job-wide ranks of the group's members, in group-rank order.
    pub fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }

    /// This process's job-wide rank.
    pub fn global_rank(&self) -> usize {
        self.global_ranks[self.rank]
    }

    pub(crate) fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let ran = crate::work::RunTimes::default();
        let times = ran.clone();
        let job: Job = Box::new(move |engine: &mut Engine| {
            let _ = tx.send(crate::work::run_timed(&times, || engine.run(f)));
        });
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sender) = jobs.as_ref() {
            let _ = sender.send(job);
        }
        Work::from_channel_timed(rx, self.global_rank(), ran)
    }

    /// Element-wise reduction across ranks; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.submit(move |e| e.all_reduce(buf, op))
    }

    /// Concatenation of every rank's `input` (all the same length) in rank order.
    pub fn all_gather<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.submit(move |e| e.all_gather(input))
    }

    /// [`ProcessGroup::all_gather`] into a caller's buffer (resized to fit), so steady-state
    /// callers allocate nothing; returns (input, output) for reuse.
    pub fn all_gather_into<T: Element>(
        &self,
        input: Vec<T>,
        output: Vec<T>,
    ) -> Work<(Vec<T>, Vec<T>)> {
        self.submit(move |e| e.all_gather_into(input, output))
    }

    /// [`ProcessGroup::all_gather`] into `output`, whose block `rank` already holds this
    /// rank's input (see [`crate::Communicator::all_gather_in_place`]).
    pub fn all_gather_in_place<T: Element>(&self, output: Vec<T>) -> Work<Vec<T>> {
        self.submit(move |e| e.all_gather_in_place(output))
    }

    /// [`ProcessGroup::reduce_scatter`] into a caller's buffer; `input` is used as scratch.
    /// Returns (input, output) for reuse.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: Vec<T>,
        output: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        self.submit(move |e| e.reduce_scatter_into(input, output, op))
    }

    /// Concatenation of inputs of different lengths; `counts[r]` is rank r's length.
    pub fn all_gather_v<T: Element>(&self, input: Vec<T>, counts: Vec<usize>) -> Work<Vec<T>> {
        self.submit(move |e| e.all_gather_v(input, counts))
    }

    /// Reduces `input` (length `size * k`) across ranks; rank r gets elements `r*k..(r+1)*k`.
    pub fn reduce_scatter<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        self.submit(move |e| e.reduce_scatter(input, op))
    }

    /// `root`'s buffer on every rank (every rank passes a buffer of the same length).
    pub fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.submit(move |e| e.broadcast(buf, root))
    }

    /// Every rank's `input` concatenated on `root` (`None` elsewhere).
    pub fn gather<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        self.submit(move |e| e.gather(input, root))
    }

    /// `root` splits `input` (length `size * k`, ignored elsewhere) and rank r gets part r.
    pub fn scatter<T: Element>(&self, input: Vec<T>, k: usize, root: usize) -> Work<Vec<T>> {
        self.submit(move |e| e.scatter(input, k, root))
    }

    /// Each rank's `input` (length `size * k`) cut into `size` parts: rank r gets part r of
    /// every rank, in rank order (the exchange a quantized reduction is built on).
    pub fn all_to_all<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.submit(move |e| e.all_to_all(input))
    }

    /// Returns when every rank has reached it.
    pub fn barrier(&self) -> Work<()> {
        self.submit(|e| e.barrier())
    }

    /// Returns when every member has called `join` with the same `what`, or fails within
    /// `timeout` naming the members that did not (through the rendezvous store, so a rank
    /// that never arrives is named instead of being waited for).
    pub fn join(&self, what: &str, timeout: std::time::Duration) -> Result<()> {
        let Some(store) = &self.store else {
            return Ok(());
        };
        let n = self.joins.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("{}/join/{n}/", self.name);
        store.set(&format!("{prefix}{}", self.rank), what.as_bytes())?;
        let keys: Vec<String> = (0..self.size).map(|r| format!("{prefix}{r}")).collect();
        if let Err(missing) = store.wait(&keys, timeout)? {
            let missing = missing
                .iter()
                .filter_map(|k| k.rsplit('/').next()?.parse::<usize>().ok())
                .filter_map(|r| self.global_ranks.get(r).copied())
                .collect();
            return Err(CommError::NotJoined {
                rank: self.global_rank(),
                what: what.into(),
                missing,
                timeout,
            });
        }
        for (r, key) in keys.iter().enumerate() {
            let theirs = store.get(key)?.unwrap_or_default();
            if theirs != what.as_bytes() {
                return Err(CommError::Mismatch {
                    rank: self.global_rank(),
                    peer: self.global_ranks[r],
                    mine: format!("join({what})"),
                    theirs: format!("join({})", String::from_utf8_lossy(&theirs)),
                });
            }
        }
        Ok(())
    }

    /// One block of `block_bytes` per rank in `slots` slots that every rank maps
    /// ([`SharedBlocks`]: collectives that copy each byte once); `None` where this group's data
    /// does not go through shared memory. Every rank calls it in the same order as its other
    /// `shared_blocks` calls, with the same arguments (different ones are a `Mismatch`).
    pub fn shared_blocks(&self, block_bytes: usize, slots: usize) -> Result<Option<SharedBlocks>> {
        let (Some((seg, inbox)), Some(store)) = (&self.shm, &self.store) else {
            return Ok(None);
        };
        let max = crate::shm::MAX_SLOTS;
        if block_bytes == 0 || slots == 0 || slots > max {
            return Err(CommError::InvalidArgument {
                rank: self.global_rank(),
                op: "shared_blocks".into(),
                reason: format!(
                    "{block_bytes} bytes in {slots} slots: bytes must be positive, slots 1 to {max}"
                ),
            });
        }
        let id = self.blocks_made.fetch_add(1, Ordering::SeqCst);
        let group = BlocksRendezvous {
            store,
            name: &self.name,
            me: self.rank,
            members: &self.global_ranks,
            options: &self.options,
            seg: seg.clone(),
            inbox: inbox.clone(),
            bytes_sent: self.bytes_sent.clone(),
        };
        setup_shared_blocks(group, id, block_bytes, slots).map(Some)
    }

    /// Sends `buf` to rank `dst`.
    pub fn send<T: Element>(&self, buf: Vec<T>, dst: usize) -> Work<()> {
        self.submit(move |e| e.send(buf, dst))
    }

    /// Receives `len` elements from rank `src`.
    pub fn recv<T: Element>(&self, len: usize, src: usize) -> Work<Vec<T>> {
        self.submit(move |e| e.recv(len, src))
    }

    /// A group of some of this group's ranks (group ranks, ascending order not required but
    /// no duplicates). Every rank of this group must call it, in the same order as its other
    /// `new_group` calls; non-members get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let n = self.subgroups.fetch_add(1, Ordering::SeqCst);
        let invalid = |reason: String| CommError::InvalidArgument {
            rank: self.global_rank(),
            op: "new_group".into(),
            reason,
        };
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != ranks.len() || ranks.iter().any(|&r| r >= self.size) || ranks.is_empty()
        {
            return Err(invalid(format!(
                "ranks {ranks:?} must be distinct ranks below {}",
                self.size
            )));
        }
        let Some(me) = ranks.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        let members: Vec<usize> = ranks.iter().map(|&r| self.global_ranks[r]).collect();
        let name = format!(
            "{}.{n}[{}]",
            self.name,
            members
                .iter()
                .map(|r| r.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let (streams, shm) = match (&self.store, members.len()) {
            (_, 1) => (Vec::new(), None),
            (Some(store), _) => (
                connect_mesh(store, &name, me, &members, &self.data_ip, &self.options)?,
                setup_shm(store, &name, me, &members, &self.options)?,
            ),
            (None, _) => {
                return Err(invalid(
                    "no rendezvous store in a single-process job".into(),
                ));
            }
        };
        ProcessGroup::start(
            me,
            members,
            self.store.clone(),
            self.server.clone(),
            self.options.clone(),
            self.data_ip.clone(),
            name,
            streams,
            shm,
        )
        .map(Some)
    }

    /// Splits the group into a 2-D mesh of `replicas` × `shard_size` ranks (rank
    /// `r = replica * shard_size + shard`): returns (the shard group: ranks of this replica;
    /// the replicate group: ranks with this shard index). Used by hybrid sharding.
    pub fn mesh_2d(&self, shard_size: usize) -> Result<(ProcessGroup, ProcessGroup)> {
        if shard_size == 0 || !self.size.is_multiple_of(shard_size) {
            return Err(CommError::InvalidArgument {
                rank: self.global_rank(),
                op: "mesh_2d".into(),
                reason: format!(
                    "shard size {shard_size} does not divide group size {}",
                    self.size
                ),
            });
        }
        let replicas = self.size / shard_size;
        let (my_replica, my_shard) = (self.rank / shard_size, self.rank % shard_size);
        let mut shard_group = None;
        for replica in 0..replicas {
            let ranks: Vec<usize> = (0..shard_size).map(|s| replica * shard_size + s).collect();
            let g = self.new_group(&ranks)?;
            if replica == my_replica {
                shard_group = g;
            }
        }
        let mut replicate_group = None;
        for shard in 0..shard_size {
            let ranks: Vec<usize> = (0..replicas).map(|r| r * shard_size + shard).collect();
            let g = self.new_group(&ranks)?;
            if shard == my_shard {
                replicate_group = g;
            }
        }
        match (shard_group, replicate_group) {
            (Some(s), Some(r)) => Ok((s, r)),
            _ => Err(CommError::InvalidArgument {
                rank: self.global_rank(),
                op: "mesh_2d".into(),
                reason: "internal error: this rank is missing from its mesh groups".into(),
            }),
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Finish queued work, then close the links.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
