//! Process groups: joining a job through the rendezvous store, the mesh of peer links, and
//! collectives run in FIFO order on a per-group communication thread, returned as
//! [`Work`] handles so callers overlap communication with compute.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::algorithms::{Engine, Net};
use crate::dtype::{Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::shm::Segment;
use crate::store::{StoreClient, StoreServer, constant_time_eq};
use crate::transport::Links;
use crate::world::WorldInfo;

/// Environment variable holding the per-job secret (set by `fsdp launch`).
pub const SECRET_ENV: &str = "FSDP_JOB_SECRET";
/// Environment variable: collective timeout in seconds.
pub const TIMEOUT_ENV: &str = "FSDP_COMM_TIMEOUT_SECS";
/// Environment variable: rendezvous timeout in seconds.
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "FSDP_RENDEZVOUS_TIMEOUT_SECS";
/// Environment variable: `auto` (shared memory when every member is on this host, else TCP),
/// `tcp` or `shm`.
pub const TRANSPORT_ENV: &str = "FSDP_COMM_TRANSPORT";

/// Environment variable: set to 1 when the launcher hosts the rendezvous store (rank 0 then
/// connects to it like every other rank).
pub const STORE_HOSTED_ENV: &str = "FSDP_STORE_HOSTED";
/// Environment variable: prefix of this attempt's keys in the store (a restarted job uses a
/// new prefix on the same store).
pub const PREFIX_ENV: &str = "FSDP_RENDEZVOUS_PREFIX";

/// Which transport carries a group's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory when all members share this host, TCP otherwise.
    Auto,
    /// TCP only (for testing the network path on one host).
    Tcp,
    /// Shared memory; an error if members are on different hosts.
    Shm,
}

/// How a group behaves when things go wrong.
#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long a collective may wait for a peer that is alive (compute skew). A dead peer
    /// is detected as soon as its connection closes, regardless of this.
    pub timeout: Duration,
    /// How long to wait for every rank to arrive.
    pub rendezvous_timeout: Duration,
    /// The per-job secret every process must present.
    pub secret: Vec<u8>,
    /// Which transport carries data.
    pub transport: TransportChoice,
    /// Whether rank 0 starts the store (false when the launcher hosts it).
    pub host_store: bool,
    /// Prefix of this job attempt's store keys.
    pub store_prefix: String,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            timeout: Duration::from_secs(300),
            rendezvous_timeout: Duration::from_secs(120),
            secret: Vec::new(),
            transport: TransportChoice::Auto,
            host_store: true,
            store_prefix: String::new(),
        }
    }
}

impl GroupOptions {
    /// Defaults overridden by `FSDP_COMM_TIMEOUT_SECS`, `FSDP_RENDEZVOUS_TIMEOUT_SECS`,
    /// `FSDP_JOB_SECRET` and `FSDP_COMM_TRANSPORT` (an unknown transport name is treated as
    /// `auto`).
    pub fn from_env() -> GroupOptions {
        let secs = |var: &str| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.trim().parse::<f64>().ok())
                .filter(|s| *s > 0.0)
                .map(Duration::from_secs_f64)
        };
        let d = GroupOptions::default();
        GroupOptions {
            timeout: secs(TIMEOUT_ENV).unwrap_or(d.timeout),
            rendezvous_timeout: secs(RENDEZVOUS_TIMEOUT_ENV).unwrap_or(d.rendezvous_timeout),
            secret: std::env::var(SECRET_ENV).unwrap_or_default().into_bytes(),
            transport: match std::env::var(TRANSPORT_ENV)
                .unwrap_or_default()
                .to_ascii_lowercase()
                .as_str()
            {
                "tcp" => TransportChoice::Tcp,
                "shm" => TransportChoice::Shm,
                _ => TransportChoice::Auto,
            },
            host_store: std::env::var(STORE_HOSTED_ENV).map_or(true, |v| v.trim() != "1"),
            store_prefix: std::env::var(PREFIX_ENV).unwrap_or_default(),
        }
    }
}

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// A handle to a collective that is queued or running.
#[must_use = "a collective's result is only known after wait()"]
pub struct Work<T> {
    rx: mpsc::Receiver<Result<T>>,
    rank: usize,
}

impl<T> Work<T> {
    /// Blocks until the collective finishes and returns its result.
    pub fn wait(self) -> Result<T> {
        self.rx
            .recv()
            .unwrap_or(Err(CommError::Closed { rank: self.rank }))
    }
}

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
    transport: &'static str,
    bytes_sent: Arc<AtomicU64>,
}

impl ProcessGroup {
    /// Joins the job described by this process's environment (see [`WorldInfo::from_env`]).
    pub fn from_env() -> Result<ProcessGroup> {
        let world = WorldInfo::from_env().map_err(|e| CommError::InvalidArgument {
            rank: 0,
            op: "process group initialisation".into(),
            reason: e.to_string(),
        })?;
        ProcessGroup::init(&world, GroupOptions::from_env())
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
        let streams = connect_mesh(&store, &name, rank, &members, &world.master_addr, &options)?;
        let shm = setup_shm(&store, &name, rank, &members, &options)?;
        ProcessGroup::start(
            rank,
            members,
            Some(store),
            server,
            options,
            world.master_addr.clone(),
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
            transport,
            bytes_sent,
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

    fn global_rank(&self) -> usize {
        self.global_ranks[self.rank]
    }

    fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> Result<T> + Send + 'static,
    ) -> Work<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |engine: &mut Engine| {
            let _ = tx.send(engine.run(f));
        });
        let jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sender) = jobs.as_ref() {
            let _ = sender.send(job);
        }
        Work {
            rx,
            rank: self.global_rank(),
        }
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

    /// Returns when every rank has reached it.
    pub fn barrier(&self) -> Work<()> {
        self.submit(|e| e.barrier())
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
        if shard_size == 0 || self.size % shard_size != 0 {
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

const HELLO_MAGIC: &[u8; 8] = b"FSDPHELO";

/// This host's identity: members with the same one can share memory.
fn host_id() -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// Creates (member 0) or maps (the others) the group's shared-memory segment when every
/// member runs on this host and the options allow it. Member 0 unlinks the file once all have
/// mapped it, so nothing is left in /dev/shm even if a process crashes later.
fn setup_shm(
    store: &StoreClient,
    name: &str,
    me: usize,
    members: &[usize],
    options: &GroupOptions,
) -> Result<Option<Arc<Segment>>> {
    let rank = members[me];
    let n = members.len();
    if options.transport == TransportChoice::Tcp || n < 2 {
        return Ok(None);
    }
    store.set(&format!("{name}/host/{me}"), host_id().as_bytes())?;
    let keys: Vec<String> = (0..n).map(|i| format!("{name}/host/{i}")).collect();
    if let Err(missing) = store.wait(&keys, options.rendezvous_timeout)? {
        return Err(CommError::RendezvousTimeout {
            rank,
            missing: missing_members(&missing, members),
            timeout: options.rendezvous_timeout,
        });
    }
    let mine = host_id();
    let mut same_host = true;
    for key in &keys {
        same_host &= store.get(key)?.as_deref() == Some(mine.as_bytes());
    }
    if !same_host {
        return match options.transport {
            TransportChoice::Shm => Err(CommError::InvalidArgument {
                rank,
                op: "process group initialisation".into(),
                reason: format!(
                    "{TRANSPORT_ENV}=shm but the members of group `{name}` are on different hosts"
                ),
            }),
            _ => Ok(None),
        };
    }
    let io = |what: &str, e: std::io::Error| CommError::Io {
        rank,
        what: what.to_string(),
        message: e.to_string(),
    };
    let path_key = format!("{name}/shm_path");
    let mapped_keys: Vec<String> = (1..n).map(|i| format!("{name}/shm_mapped/{i}")).collect();
    if me == 0 {
        let safe: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/fsdp-{}-{safe}-{nanos}",
            std::process::id()
        ));
        let seg = Segment::create(&path, n, me)
            .map_err(|e| io(&format!("creating shared memory {}", path.display()), e))?;
        let unlink = Unlink(path.clone());
        store.set(&path_key, path.to_string_lossy().as_bytes())?;
        if let Err(missing) = store.wait(&mapped_keys, options.rendezvous_timeout)? {
            return Err(CommError::RendezvousTimeout {
                rank,
                missing: missing_members(&missing, members),
                timeout: options.rendezvous_timeout,
            });
        }
        drop(unlink);
        Ok(Some(Arc::new(seg)))
    } else {
        if let Err(missing) =
            store.wait(std::slice::from_ref(&path_key), options.rendezvous_timeout)?
        {
            return Err(CommError::RendezvousTimeout {
                rank,
                missing: missing_members(&missing, members),
                timeout: options.rendezvous_timeout,
            });
        }
        let path = std::path::PathBuf::from(
            String::from_utf8_lossy(&store.get(&path_key)?.unwrap_or_default()).into_owned(),
        );
        let seg = Segment::open(&path, n, me)
            .map_err(|e| io(&format!("mapping shared memory {}", path.display()), e))?;
        store.set(&format!("{name}/shm_mapped/{me}"), b"1")?;
        Ok(Some(Arc::new(seg)))
    }
}

/// Removes a file when dropped (on success and on every error path).
struct Unlink(std::path::PathBuf);

impl Drop for Unlink {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Job-wide ranks of the members whose `.../<index>` keys are missing.
fn missing_members(missing: &[String], members: &[usize]) -> Vec<usize> {
    missing
        .iter()
        .filter_map(|k| k.rsplit('/').next()?.parse::<usize>().ok())
        .filter_map(|i| members.get(i).copied())
        .collect()
}

/// Registers this rank under `name` in the store and connects to every other member: lower
/// ranks dial higher ones' listeners. `me` is the index into `members` (global ranks).
fn connect_mesh(
    store: &StoreClient,
    name: &str,
    me: usize,
    members: &[usize],
    ip: &str,
    options: &GroupOptions,
) -> Result<Vec<Option<TcpStream>>> {
    let rank = members[me];
    let n = members.len();
    let io = |what: String, e: std::io::Error| CommError::Io {
        rank,
        what,
        message: e.to_string(),
    };
    let token = format!("{}-{:?}", std::process::id(), Instant::now());
    let claimed = store.compare_set(&format!("{name}/claim/{me}"), None, token.as_bytes())?;
    if claimed.as_deref() != Some(token.as_bytes()) {
        return Err(CommError::Refused {
            rank,
            reason: format!("rank {rank} of group `{name}` is already claimed by another process"),
        });
    }
    let size = n.to_string();
    let agreed = store.compare_set(&format!("{name}/size"), None, size.as_bytes())?;
    if agreed.as_deref() != Some(size.as_bytes()) {
        return Err(CommError::Refused {
            rank,
            reason: format!(
                "world size mismatch in group `{name}`: this rank has {n}, another rank registered {}",
                String::from_utf8_lossy(&agreed.unwrap_or_default())
            ),
        });
    }
    let listener = TcpListener::bind((ip, 0)).map_err(|e| io(format!("listening on {ip}"), e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io("listener address".into(), e))?;
    store.set(&format!("{name}/addr/{me}"), addr.to_string().as_bytes())?;
    let keys: Vec<String> = (0..n).map(|i| format!("{name}/addr/{i}")).collect();
    if let Err(missing) = store.wait(&keys, options.rendezvous_timeout)? {
        return Err(CommError::RendezvousTimeout {
            rank,
            missing: missing_members(&missing, members),
            timeout: options.rendezvous_timeout,
        });
    }
    let deadline = Instant::now() + options.rendezvous_timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    for (peer, key) in keys.iter().enumerate().take(me) {
        let peer_addr = String::from_utf8_lossy(&store.get(key)?.unwrap_or_default()).into_owned();
        let target = peer_addr
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                io(
                    format!("resolving rank {}'s address {peer_addr}", members[peer]),
                    std::io::Error::other("bad address"),
                )
            })?;
        let mut stream =
            TcpStream::connect_timeout(&target, Duration::from_secs(10)).map_err(|e| {
                io(
                    format!("connecting to rank {} at {peer_addr}", members[peer]),
                    e,
                )
            })?;
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&(me as u32).to_le_bytes());
        hello.extend_from_slice(&(options.secret.len() as u32).to_le_bytes());
        hello.extend_from_slice(&options.secret);
        stream
            .write_all(&hello)
            .map_err(|e| io(format!("greeting rank {}", members[peer]), e))?;
        streams[peer] = Some(stream);
    }
    listener
        .set_nonblocking(true)
        .map_err(|e| io("listener".into(), e))?;
    let mut expected = n - 1 - me;
    while expected > 0 {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Some(peer) = read_hello(&mut stream, &options.secret, n)
                    && peer > me
                    && streams[peer].is_none()
                {
                    streams[peer] = Some(stream);
                    expected -= 1;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (me + 1..n)
                        .filter(|p| streams[*p].is_none())
                        .map(|p| members[p])
                        .collect();
                    return Err(CommError::RendezvousTimeout {
                        rank,
                        missing,
                        timeout: options.rendezvous_timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io("accepting peer connections".into(), e)),
        }
    }
    Ok(streams)
}

/// Reads a peer's greeting; `None` for anything that is not a member presenting the secret.
fn read_hello(stream: &mut TcpStream, secret: &[u8], n: usize) -> Option<usize> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = [0u8; 16];
    stream.read_exact(&mut head).ok()?;
    if &head[..8] != HELLO_MAGIC {
        return None;
    }
    let peer = u32::from_le_bytes(head[8..12].try_into().ok()?) as usize;
    let len = u32::from_le_bytes(head[12..16].try_into().ok()?) as usize;
    if len != secret.len() || peer >= n {
        return None;
    }
    let mut presented = vec![0u8; len];
    stream.read_exact(&mut presented).ok()?;
    stream.set_read_timeout(None).ok()?;
    constant_time_eq(&presented, secret).then_some(peer)
}
