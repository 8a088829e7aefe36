/*
 * What the card model's two files share (cuda_exec.c, the card: its shared file and the
 * simulation; cuda_queues.c above it, this process's contexts, queues, events and launches). Not
 * the stand-in's other files' (they call cuda_stub.h's stub_exec_* only). Hidden, as cuda_stub.h's.
 */
#ifndef CGPU_CUDA_EXEC_H
#define CGPU_CUDA_EXEC_H
#include <pthread.h>
#include <sys/types.h>

#include "cuda_stub.h"

#define NCARDS 16
#define NCTX 32        /* contexts (processes) per card */
#define RING 4096      /* queued entries per context, all streams together */
#define NSTREAMS 16    /* streams told apart per context (more share a record) */
#define NPIECES 4096   /* logged pieces waiting for their owner to write them */
#define NEVER UINT64_MAX
#define SPIN_NS 200000ull
#define EXEC_MAGIC 0x6367707565786533ull  /* "cgpuexe3" */
#define STAMP_NS 512ull  /* the card's timestamps' resolution (cuEventElapsedTime's documented ~0.5 µs) */

/* cum: ns of entries 0..this; stamp: the card's timestamp of its end (an event's time: inexact);
 * ov: ns its first piece overlapped the entry before (a programmatic dependent launch) */
struct entry { uint64_t ns, cum, ready, end, stamp, ov; uint32_t stream, coll, kind, pad; };
enum { K_KERNEL = 0, K_MARK = 1, K_PDL = 2 };  /* kind: a kernel; an event's record; a kernel launched programmatic-dependent */
struct sstream { uint64_t id, last, enq, done; };  /* last: seq + 1 of its last entry (0: none) */
struct piece { uint64_t start, end, us; int32_t dev, coll; };
struct ctx {
    uint64_t owner;        /* its process's token (pids are no names across PID namespaces; 0: free) */
    uint64_t head, tail;   /* entries [head, tail) queued; head runs first */
    uint64_t left;         /* ns the head entry has left once it started (0: not started; NEVER: a half spinning) */
    uint64_t coll_enq, coll_start, checked;
    uint64_t group;        /* its collectives' group: its halves pair with the other card's context of the same group */
    uint64_t piece_w, piece_r, lost;
    int32_t pid, pad2;     /* the owner's pid (as it sees it: its log's lines say so) */
    uint64_t last_stamp;   /* its newest timestamp (the card writes them in order: never earlier) */
    char log[240];         /* the owner's log (CGPU_STUB_CUDA_LOG), for when its pieces overflow */
    struct sstream streams[NSTREAMS];
};
/* A context's queue and its pieces, after the cards (the records above stay on a few pages) */
struct bulk { struct piece pieces[NPIECES]; struct entry ring[RING]; };
enum { IDLE = 0, SWITCH = 1, RUN = 2 };
struct card {
    uint64_t magic, t;     /* simulated up to t */
    int32_t cur, state;    /* cur: the context on the card (-1: none yet) */
    int32_t next, pad;     /* SWITCH: the context being switched to */
    uint64_t until, piece_start, slice_end;
    uint32_t busy, pad2;   /* contexts with queued work */
    uint64_t rng;          /* the card's own inexactness (slices, switches, timestamps): xorshift64 */
    struct ctx ctx[NCTX];
};

#define MAP_SIZE (sizeof(struct card) * NCARDS + sizeof(struct bulk) * NCARDS * NCTX)
/* ---- cuda_exec.c: the shared file (mapped once per process) and the simulation (under the lock) ---- */
extern HIDDEN struct card *cards;
extern HIDDEN pid_t mapped_by;
extern HIDDEN uint64_t me;    /* this process's token (a forked child draws its own) */
extern HIDDEN int log_fd;     /* its kernel log (CGPU_STUB_CUDA_LOG), -1: none */
HIDDEN int attach(void);      /* the card file mapped: 0, -1 */
HIDDEN void enter(void);      /* the lock: this process's threads', and the file's (flock) */
HIDDEN void leave(void);
HIDDEN void advance(uint64_t t);  /* every card simulated up to t (under the lock) */
HIDDEN int ncards(void);          /* the card records in use (an MPS client's lanes too) */
HIDDEN uint64_t now_ns(void);
HIDDEN void sleep_until(uint64_t ns);
HIDDEN uint64_t depth(void);      /* CGPU_STUB_QUEUE_DEPTH */
HIDDEN uint64_t launch_ns(void);  /* CGPU_STUB_LAUNCH_US */
HIDDEN uint64_t event_card_ns(void), event_host_ns(void);  /* an event's record's cost to the card, the host */
HIDDEN uint64_t stamp_of(struct card *k, struct ctx *c, uint64_t t);  /* the card's timestamp of t */
HIDDEN struct entry *entry_of(const struct ctx *c, uint64_t seq);
HIDDEN struct entry *head_entry(const struct ctx *c);
HIDDEN int has_work(const struct card *k, int i);
HIDDEN int hold_live(int dev, int i);  /* context i of card dev is held by a live process (its lock taken) */
HIDDEN uint64_t next_event(struct card *k);  /* when card k's state next changes (NEVER: idle) */
HIDDEN size_t take_lines(struct ctx *c, char *buf, size_t cap);  /* its logged pieces as log lines */
#endif
