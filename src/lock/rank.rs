//! The crate's lock table: every lock's rank, lowest first.
//!
//! A thread may take a lock only while every lock it holds has a lower rank. The table in
//! docs/ARCHITECTURE.md §7 is this list, row for row (a unit test compares the two): adding a lock
//! means adding a row here and running `python3 scripts/lock-table.py`, which rewrites the table
//! there (numbers are positions: renumber the rows here when inserting one).

macro_rules! ranks {
    ($( $variant:ident = $number:literal, $name:literal, $guards:literal; )*) => {
        /// A lock's place in the crate's lock order (docs/ARCHITECTURE.md §7).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub(crate) enum Rank {
            $( #[doc = $guards] $variant, )*
        }

        // The checker that reads these is compiled with `debug_assertions` only.
        #[cfg_attr(not(debug_assertions), allow(dead_code))]
        impl Rank {
            /// Every rank, lowest first.
            #[allow(dead_code)]
            pub(crate) const ALL: &'static [Rank] = &[ $( Rank::$variant, )* ];

            /// The rank's number: a lock may be taken only under locks of lower numbers.
            pub(crate) const fn number(self) -> u32 {
                match self { $( Rank::$variant => $number, )* }
            }

            /// The lock, as the table names it.
            pub(crate) const fn name(self) -> &'static str {
                match self { $( Rank::$variant => $name, )* }
            }

            /// What the lock guards, as the table says.
            #[allow(dead_code)]
            pub(crate) const fn guards(self) -> &'static str {
                match self { $( Rank::$variant => $guards, )* }
            }
        }
    };
}

ranks! {
    Manager = 1, "MemoryManager::inner", "the registry, the staging pool handle; held while a load is planned and executed (serializes loads)";
    Dynamic = 2, "loader::Dynamic", "residency by use: a fault-in's decision, evictions and booking; a commit; the manager noting a device's resident figure";
    StreamerQueue = 3, "offload::Streamer queue", "one model's prefetched weights";
    StreamerGate = 4, "offload::Streamer gate", "where one model's prefetches book their bytes";
    CastCache = 5, "ops::CastCache entries", "one model's cached manual casts";
    ModelState = 6, "Model::state", "residency and pins of one model";
    ForwardOrder = 7, "Model::forward_order", "the first forward's order of weight uses";
    CandleDevices = 8, "vram candle device table", "one candle device per ordinal";
    OpsPatcher = 9, "ops::OpsSource patcher", "which patcher layers fetch through (held only to clone an `Arc`)";
    StreamHook = 10, "Model::stream_hook and cast_hook", "a test's hooks on a model's materializations";
    KeepCounts = 11, "MemoryManager keep counts", "models kept by `KeepGuard`s";
    LedgerNamed = 12, "loader::Ledger named reservations", "the reservations' names and sizes";
    LedgerBooks = 13, "loader::Ledger books", "bytes in flight, cached, reserved, bounds and peaks per device";
    LedgerProbes = 14, "loader::Ledger free probes", "the driver free-memory query per device (called after release)";
    HostTier = 15, "weights::HostTier books (and its condition variable)", "host copies, the host ledger, pins in place";
    StagingPool = 16, "offload::PinnedPool free lists", "idle page-locked staging buffers by size class";
    PinFences = 17, "weights::PinnedWeight::fences", "the events of the copies out of a pinned weight, one per stream";
    Derived = 18, "Model::derived", "a managed model's module built from its resident copies (dropped outside every lock)";
    ManagerCasts = 19, "MemoryManager cast caches", "the manual-cast caches the manager attached";
    EngineQueue = 20, "offload::TransferEngine queue and workers", "the lanes' job sender and threads";
    LaneJobs = 21, "transfer lanes' job receiver", "held by an idle lane while it waits for its next job";
    KernelResult = 22, "a lane kernel's result slot", "a weight built by a kernel on a copy's stream";
    SimDefaultStream = 23, "device::SimGpu default stream", "a simulated GPU's default stream, made on first use";
    SimStream = 24, "sim stream queue (and its condition variable)", "a simulated stream's queued work";
    SimBuffer = 25, "sim device buffer pending copies (and its condition variable)", "copies still writing a simulated device buffer";
    SimBufferWriter = 26, "sim device buffer writer", "the stream and op of the latest copy into a simulated device buffer";
    SimBufferStorage = 27, "sim device buffer storage", "a simulated device buffer's bytes";
    SimEvent = 28, "sim event (and its condition variable)", "an event's latest recording and completions";
    SimGpu = 29, "device::SimGpu books (and its condition variable)", "a simulated GPU's allocations, page-locked ranges, faults and findings";
    NnHandedOut = 30, "nn tensors handed out", "tensors handed out by managed accessors, and by `VarBuilder::get` until a layer adopts them";
    HeldOutside = 31, "weights held-outside table", "the tensors each model's code holds as its own, outside the ledger, and the copies kept of them";
    WarnLatch = 32, "warning latches (warnings::latch and the stderr copies' latch)", "warnings already emitted or printed";
    DynamicStats = 33, "loader::Dynamic statistics", "hits, misses, faults-in and the recorded uses, per device";
    ManagerView = 34, "MemoryManager::view", "the registry as reports read it (published when the manager lock is released)";
    MissCosts = 35, "offload::MissCosts figures", "the measured costs of cost-aware misses and their counts";
    Costs = 36, "costs::CostModel figures", "each device's link figure and its fit (a leaf: held to read or add a sample)";
    Audits = 37, "MemoryManager audits", "the last step audit of each model (a leaf)";
    DepthChoices = 38, "MemoryManager depth choices", "the planner's last prefetch-depth choice per model and what it was made for (a leaf)";
    PreparedHost = 39, "offload::PreparedCopies entries", "a model's prepared host copies of quantized weights run on the host";
    Trace = 40, "trace::Trace records", "a recording's records (an event may be emitted under any lock above)";
    TrackNames = 41, "trace track names", "each thread's track number and name";
    EngineStreamers = 42, "offload::TransferEngine streamers", "the streamers prefetching through one engine (a leaf: held to clone their handles)";
    StreamerBookings = 43, "offload::Streamer bookings outstanding", "bytes a streamer booked on the ledger and has not returned, by device (a leaf)";
}

#[cfg_attr(not(debug_assertions), allow(dead_code))]
impl Rank {
    /// Whether the same thread may read this lock again while it holds a read of it. None may:
    /// every re-read is a potential deadlock behind a queued writer.
    pub(crate) const fn recursive(self) -> bool {
        false
    }

    /// Whether a thread may wait (for a device copy, an event, another lock's condition variable)
    /// while holding this lock. Only the manager lock allows it: a load unpins weights that
    /// become GPU-resident and `cleanup_models` trims the staging pool under it, and both wait
    /// for copies out of the memory they release.
    pub(crate) const fn may_wait(self) -> bool {
        matches!(self, Rank::Manager)
    }
}
