// A block's threads as fibers on one OS thread. A fiber runs until it reaches a barrier
// (`__syncthreads`, `__syncwarp`, a shuffle) or returns, and switches to the next. A
// warp's lanes run first to their next warp barrier, which releases once every live lane of the
// warp is there; when no lane of any warp can go on, every live thread must be at the block
// barrier, which then releases. Anything else is a kernel bug the device would hang on or
// compute garbage from, and fails the launch by name: lanes of a warp split between a shuffle
// and `__syncthreads`, a shuffle whose lane already returned, differing shuffle masks.
//
// Between barriers a thread runs alone until its next one, and the order is drawn: the blocks of
// a launch, the warps of a block and the lanes of a warp each run in an order shuffled by a
// generator seeded from $LOCKSTEP_CUDA_EMU_SEED (default 1), the launch's number and the
// block's index, so a kernel that reads what another thread writes without a barrier between
// them (or another block's output) reads it sometimes before and sometimes after, and its
// results move, while a race-free kernel's cannot.
//
// A launch's blocks are taken in that order by the launching thread and a pool of workers of
// its own ($LOCKSTEP_CUDA_EMU_THREADS in all, default the machine's cores), each running one
// block at a time: `__shared__` is thread-local storage (device.h), so it is the block's.
//
// Switching is context.h's, and a stopping fiber switches straight to the next lane of its
// warp's round; only the round's last switches back to the scheduler, which then checks the
// warp's barrier (before, every stop went by way of the scheduler: two switches, not one, and
// the emulated device checks took twice as long). A fiber's stack outlives its kernel: it loops,
// running the block it is given, so a launch starts no fiber anew.

#include "blocks.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "context.h"

namespace lockstep_emu {
namespace {

constexpr int WARP = 32;
constexpr unsigned int FULL_MASK = 0xffffffffu;
// A kernel thread's stack: its locals are registers on the device (a few hundred bytes), plus
// the runtime's frames. Reserved, not committed, until touched.
constexpr std::size_t STACK_BYTES = 256 * 1024;

enum class State { Runnable, AtWarpBarrier, AtBlockBarrier, AtWait, Done };

struct Fiber {
    Context context;
    void* stack = nullptr;
    bool started = false;  // its context runs `fiber_main`; otherwise prepared at its next run
    State state = State::Done;
    unsigned int warp_mask = FULL_MASK;
    Coordinates coordinates{};
    std::size_t index = 0;  // in its block

    Fiber() = default;
    Fiber(const Fiber&) = delete;
    Fiber& operator=(const Fiber&) = delete;
    ~Fiber() {
        if (stack != nullptr) munmap(stack, STACK_BYTES);
    }
};

// One shuffle's offers: 8 bytes a lane, in two generations so that a lane past a barrier may
// offer its next value while a slower lane still reads this one.
struct WarpSlots {
    std::uint64_t offers[2][WARP];
    int generation = 0;
};

// The launch running on this OS thread.
struct Launch {
    const Entry* entry = nullptr;
    void** parameters = nullptr;
    Coordinates* coordinates = nullptr;  // the module's, for this OS thread
    // Kept between launches, their stacks reused; a deque, so that a fiber never moves while
    // its own stack holds a reference to it.
    std::deque<Fiber> fibers;
    std::vector<WarpSlots> warps;
    std::size_t live = 0;  // the fibers of the current block
    // A checked block before its threads passed `wait_for_inputs()`: the guard is closed.
    const PreWaitGuard* closed = nullptr;
    Fiber* current = nullptr;
    Context scheduler;
    // The warp `run_round` runs, its lanes in the order drawn, and the next of them.
    std::size_t round_first = 0, round_cursor = 0;
    std::vector<std::size_t> lane_order;
    bool trapped = false;  // set by `fail` before it switches back
    std::string error;
};

thread_local Launch launch;

// $LOCKSTEP_CUDA_EMU_SEED, read once.
std::uint64_t seed() {
    static const std::uint64_t value = [] {
        const char* text = std::getenv("LOCKSTEP_CUDA_EMU_SEED");
        return text != nullptr && *text ? std::strtoull(text, nullptr, 0) : 1ull;
    }();
    return value;
}

// A scheduling order's generator (splitmix64). A launch's block order is drawn from the seed
// and the launch's number on its calling thread, a block's warp and lane orders from those and
// the block's index: the same on whichever worker runs the block.
struct Order {
    std::uint64_t state;
    explicit Order(std::uint64_t seed) : state(seed) {}
    std::uint64_t next() {
        std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    // `indices` as 0..n in an order drawn (Fisher-Yates).
    void shuffle(std::vector<std::size_t>& indices, std::size_t n) {
        indices.resize(n);
        for (std::size_t i = 0; i < n; i++) indices[i] = i;
        for (std::size_t i = n; i > 1; i--) std::swap(indices[i - 1], indices[next() % i]);
    }
};
thread_local Order order(1);
thread_local std::vector<std::size_t> warp_order;

std::string where(const Coordinates& c) {
    char text[160];
    std::snprintf(text, sizeof text, "block (%u, %u, %u), thread (%u, %u, %u)", c.block.x,
                  c.block.y, c.block.z, c.thread.x, c.thread.y, c.thread.z);
    return text;
}

[[noreturn]] void fiber_main();

// The next fiber of the warp's round (`run_round`) that can run, made current; null once the
// round is over.
Fiber* next_in_round() {
    while (launch.round_cursor < launch.lane_order.size()) {
        Fiber& fiber =
            launch.fibers[launch.round_first + launch.lane_order[launch.round_cursor++]];
        if (fiber.state != State::Runnable) continue;
        launch.current = &fiber;
        *launch.coordinates = fiber.coordinates;
        if (!fiber.started) {
            prepare(fiber.context, fiber.stack, STACK_BYTES, fiber_main);
            fiber.started = true;
        }
        return &fiber;
    }
    return nullptr;
}

// Leaves the current fiber, stopped in `state`, for the round's next one, or for the scheduler
// once the round is over: one switch a stop, not two by way of the scheduler. Returns when
// something resumes it.
void yield(State state) {
    Fiber& fiber = *launch.current;
    fiber.state = state;
    Fiber* next = next_in_round();
    switch_context(fiber.context, next != nullptr ? next->context : launch.scheduler);
}

[[noreturn]] void fiber_main() {
    for (;;) {
        launch.entry->call(launch.parameters);
        yield(State::Done);
    }
}

void sync_block() { yield(State::AtBlockBarrier); }

void sync_warp(unsigned int mask) {
    launch.current->warp_mask = mask;
    yield(State::AtWarpBarrier);
}

// Ends the launch from inside a fiber, which then starts afresh next time (its stack is left as
// it was, mid-kernel).
[[noreturn]] void fail(std::string message) {
    if (launch.error.empty()) launch.error = std::move(message);
    Fiber& fiber = *launch.current;
    fiber.started = false;
    launch.trapped = true;
    switch_context(fiber.context, launch.scheduler);
    __builtin_unreachable();  // a fiber not started is prepared afresh, never resumed
}

// A shuffled value (1, 2, 4 or 8 bytes), copied by fixed-size moves rather than a call to memcpy.
void copy_value(void* to, const void* from, unsigned int size) {
    switch (size) {
        case 8: std::memcpy(to, from, 8); break;
        case 4: std::memcpy(to, from, 4); break;
        default: std::memcpy(to, from, size);
    }
}

void exchange(unsigned int mask, const void* mine, void* out, unsigned int size, int from) {
    Fiber& fiber = *launch.current;
    WarpSlots& slots = launch.warps[fiber.index / WARP];
    const int generation = slots.generation;
    std::uint64_t offer = 0;
    copy_value(&offer, mine, size);
    slots.offers[generation][fiber.coordinates.lane] = offer;
    sync_warp(mask);
    if ((mask >> from & 1u) == 0) {
        fail("a shuffle reads lane " + std::to_string(from) + ", outside its mask, at " +
             where(fiber.coordinates));
    }
    copy_value(out, &slots.offers[generation][from], size);
}

void trap() { fail("__trap() at " + where(launch.current->coordinates)); }

// Waits, in a checked block, until every thread of the block is here (or returned); then the
// guard opens. Elsewhere the kernels before already finished: nothing to wait for.
void wait_for_inputs() {
    if (launch.closed != nullptr) yield(State::AtWait);
}

const Runtime RUNTIME = {sync_block, sync_warp, exchange, trap, wait_for_inputs};

void make_fibers(std::size_t count) {
    while (launch.fibers.size() < count) {
        launch.fibers.emplace_back();
        launch.fibers.back().index = launch.fibers.size() - 1;
    }
    for (std::size_t i = 0; i < count; i++) {
        Fiber& fiber = launch.fibers[i];
        if (fiber.stack == nullptr) {
            fiber.stack = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (fiber.stack == MAP_FAILED) {
                std::perror("lockstep cuda emulator: a fiber's stack");
                std::abort();
            }
            // The lowest page catches an overflowing kernel thread.
            mprotect(fiber.stack, 4096, PROT_NONE);
        }
    }
}

// Runs each runnable fiber of the warp starting at `first`, in `launch.lane_order`, until it stops;
// false if one trapped. Each passes to the next itself (`yield`); the last comes back here.
bool run_round(std::size_t first) {
    launch.round_first = first;
    launch.round_cursor = 0;
    Fiber* next = next_in_round();
    if (next == nullptr) return true;
    launch.trapped = false;
    switch_context(launch.scheduler, next->context);
    return !launch.trapped;
}

// Every fiber that had not finished leaves its stack mid-kernel: each starts afresh.
void abandon_block() {
    for (std::size_t i = 0; i < launch.live; i++) {
        if (launch.fibers[i].state != State::Done) launch.fibers[i].started = false;
    }
}

// Runs one warp's runnable lanes until none can go on; releases its warp barrier whenever every
// live lane reached it.
bool run_warp(std::size_t first, std::size_t last) {
    for (;;) {
        order.shuffle(launch.lane_order, last - first);
        if (!run_round(first)) return false;
        std::size_t waiting = 0;
        unsigned int mask = 0, waiting_lanes = 0, live_lanes = 0;
        bool masks_agree = true;
        for (std::size_t i = first; i < last; i++) {
            const Fiber& fiber = launch.fibers[i];
            const unsigned int lane = 1u << (i - first);
            if (fiber.state == State::Done) continue;
            live_lanes |= lane;
            if (fiber.state == State::AtWarpBarrier) {
                if (waiting > 0 && fiber.warp_mask != mask) masks_agree = false;
                mask = fiber.warp_mask;
                waiting_lanes |= lane;
                waiting++;
            }
        }
        if (waiting == 0) return true;
        const Coordinates& at = launch.fibers[first].coordinates;
        if (!masks_agree) {
            launch.error = "lanes of a warp at one barrier with different masks, " + where(at);
            return false;
        }
        // The barrier's lanes: the mask's, as far as the block has them.
        const unsigned int present = last - first == WARP ? FULL_MASK : (1u << (last - first)) - 1;
        const unsigned int expected = mask & present;
        if ((expected & ~live_lanes) != 0) {
            launch.error = "a warp barrier or shuffle waits for a lane that already returned, " +
                           where(at);
            return false;
        }
        if ((waiting_lanes & expected) != expected) return true;  // the rest of it is elsewhere
        for (std::size_t i = first; i < last; i++) {
            if ((expected >> (i - first) & 1u) != 0) launch.fibers[i].state = State::Runnable;
        }
        WarpSlots& slots = launch.warps[first / WARP];
        slots.generation ^= 1;
    }
}

bool run_block() {
    for (;;) {
        order.shuffle(warp_order, (launch.live + WARP - 1) / WARP);
        for (std::size_t warp : warp_order) {
            const std::size_t first = warp * WARP;
            const std::size_t last = std::min(first + WARP, launch.live);
            if (!run_warp(first, last)) return false;
        }
        std::size_t done = 0, waiting = 0;
        for (std::size_t i = 0; i < launch.live; i++) {
            const Fiber& fiber = launch.fibers[i];
            if (fiber.state == State::Done) {
                done++;
            } else if (fiber.state == State::AtWait) {
                waiting++;
            } else if (fiber.state != State::AtBlockBarrier) {
                launch.error = "a thread waits at a warp barrier or shuffle while its warp's other "
                               "lanes are past it or at __syncthreads, " +
                               where(fiber.coordinates);
                return false;
            }
        }
        if (done == launch.live) return true;
        if (waiting > 0) {
            // Every thread that will wait is waiting (a device's would pass the wait once the
            // kernel before finished, and threads at a barrier wait for them): open, go on.
            launch.closed->open(launch.closed->context);
            launch.closed = nullptr;
            for (std::size_t i = 0; i < launch.live; i++) {
                Fiber& fiber = launch.fibers[i];
                if (fiber.state == State::AtWait) fiber.state = State::Runnable;
            }
            continue;
        }
        for (std::size_t i = 0; i < launch.live; i++) {
            if (launch.fibers[i].state == State::AtBlockBarrier) {
                launch.fibers[i].state = State::Runnable;
            }
        }
    }
}

// Runs one block, checked or not; closes the guard for a checked one and leaves it open.
bool run_checked_block(const PreWaitGuard* guard) {
    if (guard != nullptr) {
        guard->close(guard->context);
        launch.closed = guard;
    }
    const bool completed = run_block();
    if (launch.closed != nullptr) {
        launch.closed->open(launch.closed->context);
        launch.closed = nullptr;
    }
    return completed;
}

// One launch, as the threads running its blocks share it.
struct Grid {
    const Module* module;
    const Entry* entry;
    void** parameters;
    Dim grid, block;
    std::uint64_t serial;                  // the launch's number on its calling thread
    std::vector<std::size_t> blocks;       // in the order drawn; the checked ones taken out
    std::atomic<std::size_t> next{0};      // the next of `blocks` to run
    std::atomic<bool> failed{false};
    std::mutex error_lock;
    std::string error;                     // the first failure's
};

// Readies this OS thread's fibers for `grid`'s blocks.
void join(const Grid& grid) {
    *grid.module->runtime = &RUNTIME;
    launch.entry = grid.entry;
    launch.parameters = grid.parameters;
    launch.coordinates = grid.module->coordinates();
    launch.error.clear();
    const std::size_t threads = std::size_t{grid.block.x} * grid.block.y * grid.block.z;
    make_fibers(threads);
    launch.live = threads;
    launch.warps.assign((threads + WARP - 1) / WARP, WarpSlots{});
}

// Runs block `b` (its linear index) of `grid` on this OS thread, checked by `guard` if given.
bool run_block_at(Grid& grid, std::size_t b, const PreWaitGuard* guard) {
    const Dim g = grid.grid, block = grid.block;
    const Dim at = {static_cast<unsigned int>(b % g.x), static_cast<unsigned int>(b / g.x % g.y),
                    static_cast<unsigned int>(b / g.x / g.y)};
    order = Order(seed() ^ (grid.serial * 0x2545f4914f6cdd1dull) ^ (b * 0x9e3779b97f4a7c15ull));
    std::size_t i = 0;
    for (unsigned int tz = 0; tz < block.z; tz++) {
        for (unsigned int ty = 0; ty < block.y; ty++) {
            for (unsigned int tx = 0; tx < block.x; tx++, i++) {
                Fiber& fiber = launch.fibers[i];
                const int lane = static_cast<int>(i % WARP);
                fiber.coordinates = Coordinates{{tx, ty, tz}, at, block, g, lane};
                fiber.state = State::Runnable;
                fiber.warp_mask = FULL_MASK;
            }
        }
    }
    if (run_checked_block(guard)) return true;
    abandon_block();
    std::lock_guard<std::mutex> lock(grid.error_lock);
    if (!grid.failed.exchange(true)) {
        grid.error = launch.error.empty() ? "the launch failed" : launch.error;
    }
    return false;
}

// Takes `grid`'s blocks one by one until none is left or one failed.
void take_blocks(Grid& grid) {
    join(grid);
    while (!grid.failed) {
        const std::size_t k = grid.next.fetch_add(1);
        if (k >= grid.blocks.size() || !run_block_at(grid, grid.blocks[k], nullptr)) break;
    }
    launch.current = nullptr;
}

// The OS threads that run a launch's blocks beside the thread that launched it
// ($LOCKSTEP_CUDA_EMU_THREADS in all, default the machine's cores), one pool per launching
// thread, so that launches from several threads never wait for each other's.
class Workers {
  public:
    Workers() {
        const char* set = std::getenv("LOCKSTEP_CUDA_EMU_THREADS");
        const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
        const unsigned total = set != nullptr && *set ? std::max(1, std::atoi(set)) : cores;
        for (unsigned i = 1; i < total; i++) threads_.emplace_back([this] { work(); });
    }
    ~Workers() {
        {
            std::lock_guard<std::mutex> lock(lock_);
            stopping_ = true;
        }
        wake_.notify_all();
        for (std::thread& t : threads_) t.join();
    }
    std::size_t size() const { return threads_.size() + 1; }

    // Runs `grid`'s blocks on every worker and this thread; returns when all are done.
    void run(Grid& grid) {
        {
            std::lock_guard<std::mutex> lock(lock_);
            grid_ = &grid;
            generation_++;
            busy_ = threads_.size();
        }
        wake_.notify_all();
        take_blocks(grid);
        std::unique_lock<std::mutex> lock(lock_);
        idle_.wait(lock, [this] { return busy_ == 0; });
        grid_ = nullptr;
    }

  private:
    void work() {
        std::uint64_t seen = 0;
        for (;;) {
            Grid* grid;
            {
                std::unique_lock<std::mutex> lock(lock_);
                wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
                if (stopping_) return;
                seen = generation_;
                grid = grid_;
            }
            take_blocks(*grid);
            std::lock_guard<std::mutex> lock(lock_);
            if (--busy_ == 0) idle_.notify_all();
        }
    }

    std::vector<std::thread> threads_;
    std::mutex lock_;
    std::condition_variable wake_, idle_;
    Grid* grid_ = nullptr;
    std::uint64_t generation_ = 0;
    std::size_t busy_ = 0;
    bool stopping_ = false;
};

thread_local std::uint64_t launches = 0;

}  // namespace

const char* running_kernel() {
    return launch.current != nullptr && launch.entry != nullptr ? launch.entry->name : nullptr;
}

std::string run_grid(const Module& module, const Entry& entry, Dim grid, Dim block,
                     void** parameters, const PreWaitGuard* guard) {
    const std::size_t threads = std::size_t{block.x} * block.y * block.z;
    if (threads == 0 || threads > 1024) {
        return "a block of " + std::to_string(threads) + " threads (1 to 1024)";
    }
    Grid g{&module, &entry, parameters, grid, block, launches++, {}, {}, {}, {}, {}};
    const std::size_t count = std::size_t{grid.x} * grid.y * grid.z;
    Order(seed() ^ g.serial).shuffle(g.blocks, count);
    // The guard's blocks (the grid's first and last) run alone on this thread, first: what it
    // closes is closed for the whole process.
    if (guard != nullptr) {
        join(g);
        const std::size_t checked[2] = {0, count - 1};
        for (std::size_t k = 0; k < (count > 1 ? 2 : 1); k++) {
            if (!run_block_at(g, checked[k], guard)) break;
        }
        launch.current = nullptr;
        if (g.failed) return g.error;
        g.blocks.erase(std::remove_if(g.blocks.begin(), g.blocks.end(),
                                      [&](std::size_t b) { return b == 0 || b + 1 == count; }),
                       g.blocks.end());
    }
    static thread_local std::unique_ptr<Workers> workers;
    // A few blocks are not worth waking the workers for.
    if (g.blocks.size() < 4) {
        take_blocks(g);
    } else {
        if (!workers) workers = std::make_unique<Workers>();
        if (workers->size() == 1) {
            take_blocks(g);
        } else {
            workers->run(g);
        }
    }
    return g.failed ? g.error : std::string();
}

}  // namespace lockstep_emu
