/* aot_runtime.c: the rendezvous of an ahead-of-time library whose function is partitioned over
 * several CPU devices. flowjit pastes this text into the generated wrapper (aot_c.py) after
 * defining:
 *   NUM_PARTITIONS, NUM_KEYS            partitions of the function, rendezvous keys of its transfers
 *   rendezvous_keys[NUM_KEYS]           the keys (the strings the kernels pass to send/recv)
 *   FLOWJIT_SEND, FLOWJIT_RECV,         this library's names for the kernels' flowjit_send,
 *   FLOWJIT_SEND_DONE                   flowjit_recv and flowjit_send_done (hidden symbols)
 *   run_kernel(n, in, out, scratch)     calls partition n's kernel
 * and the status codes of the header.
 *
 * One call is one step: run_partitions() puts a fresh step (mutex, condition variable, one slot per
 * key) on its stack, runs partition 0 on the calling thread and every other partition on a thread
 * of its own, joins them and returns the first failure. The kernels call send/recv at the top level
 * of their entry (never inside an OpenMP region), so the step is bound to the thread running the
 * kernel (a pthread key), exactly as the in-process runtime does (flowjit/runtime/rendezvous.py).
 *
 * One copy per transfer: a send whose recv already waits copies straight into the destination;
 * otherwise it lends its buffer (it must not wait for its receiver, or two partitions exchanging
 * values would deadlock) and the recv copies out of it. send_done returns once every loan of its
 * partition was read, so the sender's workspace is not reused while a receiver reads it. A recv
 * waits at most FLOWJIT_RECV_TIMEOUT seconds (default 600); a failed recv cancels the step, wakes
 * every waiter, zero-fills its destination so the kernel can finish, and the call returns
 * FLOWJIT_ERROR_TRANSFER.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEFAULT_RECV_TIMEOUT_S 600.0
#define PARTITION_STACK_BYTES (8u << 20)

enum slot_state {
  SLOT_EMPTY,     /* nothing happened yet */
  SLOT_WAITING,   /* the recv waits: dest is where the value goes */
  SLOT_FILLING,   /* the send is copying into dest */
  SLOT_DELIVERED, /* the value is in dest */
  SLOT_LENT,      /* the send came first: loan is the sender's buffer */
  SLOT_COPYING,   /* the recv is copying out of the loan */
  SLOT_RETURNED,  /* the recv has copied the loan */
  SLOT_CLOSED     /* received, or a loan withdrawn by a cancelled step */
};

struct slot {
  enum slot_state state;
  void* dest;
  int64_t dest_bytes;
  const void* loan;
  int64_t loan_bytes;
};

struct step {
  pthread_mutex_t mutex;
  pthread_cond_t changed;
  double timeout_s;
  int status; /* the first failure, FLOWJIT_OK while none */
  struct slot slots[NUM_KEYS];
};

/* What the thread running a partition's kernel is bound to. */
struct binding {
  struct step* step;
  int num_lent;
  int lent[NUM_KEYS]; /* keys whose buffers a receiver may still read */
};

static pthread_once_t binding_once = PTHREAD_ONCE_INIT;
static pthread_key_t binding_key;
static int binding_key_status;

static void create_binding_key(void) { binding_key_status = pthread_key_create(&binding_key, NULL); }

static int key_index(const char* key) {
  for (int k = 0; k < NUM_KEYS; k++)
    if (strcmp(rendezvous_keys[k], key) == 0) return k;
  return -1;
}

static double recv_timeout_s(void) {
  const char* raw = getenv("FLOWJIT_RECV_TIMEOUT");
  char* end = NULL;
  double value = raw != NULL ? strtod(raw, &end) : 0.0;
  return raw != NULL && end != raw && value > 0.0 ? value : DEFAULT_RECV_TIMEOUT_S;
}

static struct timespec deadline_after(double seconds) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  time_t whole = (time_t)seconds;
  long nanos = t.tv_nsec + (long)((seconds - (double)whole) * 1e9);
  t.tv_sec += whole + nanos / 1000000000L;
  t.tv_nsec = nanos % 1000000000L;
  return t;
}

/* Under the mutex: record the step's first failure and wake every waiter. */
static void cancel(struct step* s, int status) {
  if (s->status == FLOWJIT_OK) s->status = status;
  pthread_cond_broadcast(&s->changed);
}

/* Under the mutex: wait for a change; FLOWJIT_OK, or the failure that ends the wait. */
static int wait_change(struct step* s, const struct timespec* deadline) {
  if (s->status != FLOWJIT_OK) return s->status;
  if (pthread_cond_timedwait(&s->changed, &s->mutex, deadline) == ETIMEDOUT) return FLOWJIT_ERROR_TRANSFER;
  return s->status;
}

/* Kernel pointers arrive as 64-bit integers (the backend's C ABI). */
__attribute__((visibility("hidden"))) void FLOWJIT_SEND(int64_t key, int64_t data, int64_t nbytes) {
  struct binding* b = pthread_getspecific(binding_key);
  int k = key_index((const char*)(intptr_t)key);
  if (b == NULL) return;
  struct step* s = b->step;
  pthread_mutex_lock(&s->mutex);
  if (k < 0) {
    cancel(s, FLOWJIT_ERROR_TRANSFER);
  } else if (s->slots[k].state == SLOT_WAITING) {
    struct slot* slot = &s->slots[k];
    slot->state = SLOT_FILLING;
    pthread_mutex_unlock(&s->mutex);
    memcpy(slot->dest, (const void*)(intptr_t)data, (size_t)(nbytes < slot->dest_bytes ? nbytes : slot->dest_bytes));
    pthread_mutex_lock(&s->mutex);
    slot->state = SLOT_DELIVERED;
  } else if (s->slots[k].state == SLOT_EMPTY) {
    s->slots[k].loan = (const void*)(intptr_t)data;
    s->slots[k].loan_bytes = nbytes;
    s->slots[k].state = SLOT_LENT;
    b->lent[b->num_lent++] = k;
  } /* else: the recv gave up (the step is cancelled); nothing to deliver */
  pthread_cond_broadcast(&s->changed);
  pthread_mutex_unlock(&s->mutex);
}

__attribute__((visibility("hidden"))) int32_t FLOWJIT_RECV(int64_t key, int64_t dest, int64_t nbytes) {
  struct binding* b = pthread_getspecific(binding_key);
  void* out = (void*)(intptr_t)dest;
  int k = key_index((const char*)(intptr_t)key);
  if (b == NULL) {
    memset(out, 0, (size_t)nbytes);
    return 1;
  }
  struct step* s = b->step;
  pthread_mutex_lock(&s->mutex);
  int status = k < 0 ? FLOWJIT_ERROR_TRANSFER : FLOWJIT_OK;
  struct slot* slot = k < 0 ? NULL : &s->slots[k];
  if (slot != NULL && slot->state == SLOT_EMPTY) {
    struct timespec deadline = deadline_after(s->timeout_s);
    slot->dest = out;
    slot->dest_bytes = nbytes;
    slot->state = SLOT_WAITING;
    while (slot->state == SLOT_WAITING && status == FLOWJIT_OK) status = wait_change(s, &deadline);
    if (slot->state == SLOT_WAITING) {
      slot->state = SLOT_CLOSED; /* withdrawn: a late send finds it closed */
    } else {
      status = FLOWJIT_OK; /* the send arrived, even if the step failed meanwhile */
      while (slot->state == SLOT_FILLING) pthread_cond_wait(&s->changed, &s->mutex);
    }
  }
  if (slot != NULL && slot->state == SLOT_DELIVERED) {
    slot->state = SLOT_CLOSED;
    pthread_mutex_unlock(&s->mutex);
    return 0;
  }
  if (slot != NULL && slot->state == SLOT_LENT) {
    slot->state = SLOT_COPYING;
    pthread_mutex_unlock(&s->mutex);
    memcpy(out, slot->loan, (size_t)(nbytes < slot->loan_bytes ? nbytes : slot->loan_bytes));
    pthread_mutex_lock(&s->mutex);
    slot->state = SLOT_RETURNED;
    pthread_cond_broadcast(&s->changed);
    pthread_mutex_unlock(&s->mutex);
    return 0;
  }
  cancel(s, status != FLOWJIT_OK ? status : FLOWJIT_ERROR_TRANSFER);
  pthread_mutex_unlock(&s->mutex);
  memset(out, 0, (size_t)nbytes);
  return 1;
}

__attribute__((visibility("hidden"))) void FLOWJIT_SEND_DONE(void) {
  struct binding* b = pthread_getspecific(binding_key);
  if (b == NULL || b->num_lent == 0) return;
  struct step* s = b->step;
  pthread_mutex_lock(&s->mutex);
  struct timespec deadline = deadline_after(s->timeout_s);
  int status = FLOWJIT_OK;
  for (int i = 0; i < b->num_lent; i++) {
    struct slot* slot = &s->slots[b->lent[i]];
    while (status == FLOWJIT_OK && (slot->state == SLOT_LENT || slot->state == SLOT_COPYING))
      status = wait_change(s, &deadline);
  }
  if (status != FLOWJIT_OK) {
    cancel(s, status);
    for (int i = 0; i < b->num_lent; i++) { /* withdraw unread loans; let started copies finish */
      struct slot* slot = &s->slots[b->lent[i]];
      if (slot->state == SLOT_LENT) slot->state = SLOT_CLOSED;
      while (slot->state == SLOT_COPYING) pthread_cond_wait(&s->changed, &s->mutex);
    }
  }
  b->num_lent = 0;
  pthread_mutex_unlock(&s->mutex);
}

struct partition_call {
  int n;
  const void** in;
  void** out;
  char* scratch;
  struct step* step;
};

static void run_bound(struct partition_call* call) {
  struct binding b = {call->step, 0, {0}};
  void* previous = pthread_getspecific(binding_key);
  if (pthread_setspecific(binding_key, &b) != 0) {
    pthread_mutex_lock(&call->step->mutex);
    cancel(call->step, FLOWJIT_ERROR_THREAD);
    pthread_mutex_unlock(&call->step->mutex);
    return;
  }
  run_kernel(call->n, call->in, call->out, call->scratch);
  FLOWJIT_SEND_DONE(); /* every sending kernel ends with one; this only guards the invariant */
  pthread_setspecific(binding_key, previous);
}

static void* partition_thread(void* arg) {
  run_bound(arg);
  return NULL;
}

/* One step: every partition, concurrently; the first failure or FLOWJIT_OK. */
static int run_partitions(const void** in, void** out, char* scratch) {
  if (pthread_once(&binding_once, create_binding_key) != 0 || binding_key_status != 0) return FLOWJIT_ERROR_THREAD;
  struct step s;
  memset(&s, 0, sizeof s);
  s.timeout_s = recv_timeout_s();
  pthread_condattr_t cond_attr;
  if (pthread_condattr_init(&cond_attr) != 0) return FLOWJIT_ERROR_THREAD;
  pthread_condattr_setclock(&cond_attr, CLOCK_MONOTONIC);
  int init = pthread_cond_init(&s.changed, &cond_attr);
  pthread_condattr_destroy(&cond_attr);
  if (init != 0) return FLOWJIT_ERROR_THREAD;
  if (pthread_mutex_init(&s.mutex, NULL) != 0) {
    pthread_cond_destroy(&s.changed);
    return FLOWJIT_ERROR_THREAD;
  }
  struct partition_call calls[NUM_PARTITIONS];
  pthread_t threads[NUM_PARTITIONS];
  int started[NUM_PARTITIONS] = {0};
  pthread_attr_t attr;
  int have_attr = pthread_attr_init(&attr) == 0;
  if (have_attr) pthread_attr_setstacksize(&attr, PARTITION_STACK_BYTES);
  for (int n = 0; n < NUM_PARTITIONS; n++) {
    calls[n] = (struct partition_call){n, in, out, scratch, &s};
    if (n == 0) continue;
    started[n] = pthread_create(&threads[n], have_attr ? &attr : NULL, partition_thread, &calls[n]) == 0;
    if (!started[n]) { /* the partitions that did start must not wait for this one's sends */
      pthread_mutex_lock(&s.mutex);
      cancel(&s, FLOWJIT_ERROR_THREAD);
      pthread_mutex_unlock(&s.mutex);
      break;
    }
  }
  if (have_attr) pthread_attr_destroy(&attr);
  run_bound(&calls[0]);
  for (int n = 1; n < NUM_PARTITIONS; n++)
    if (started[n]) pthread_join(threads[n], NULL);
  pthread_mutex_destroy(&s.mutex);
  pthread_cond_destroy(&s.changed);
  return s.status;
}
