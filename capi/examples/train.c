/*
 * Data-parallel training from C through Tidewire's push/pull ABI.
 *
 * The model is least squares, y = W x + b, with W (M x N) and b (M) learning a
 * known target from synthetic samples. Every process computes the gradient of
 * its own batch in plain C, pushes it layer by layer (the FC layer W by its
 * sufficient factors where its scheme is SFB), and pulls the parameters the
 * servers updated with SGD. At the end it prints the loss before and after
 * and a checksum of its parameters: every worker's must be the same.
 *
 * The cluster comes from the environment (TIDEWIRE_RANK, TIDEWIRE_WORLD_SIZE,
 * TIDEWIRE_MASTER=host:port, TIDEWIRE_SECRET; or torchrun's, Slurm's, Open
 * MPI's variables). ci/capi.sh builds and runs it:
 *
 *   cc -std=c11 -Icapi/include capi/examples/train.c -Ltarget/release -ltidewire_c \
 *      -Wl,-rpath,target/release -o train
 *   TIDEWIRE_RANK=0 TIDEWIRE_WORLD_SIZE=2 TIDEWIRE_MASTER=127.0.0.1:29500 \
 *      TIDEWIRE_SECRET=s ./train &
 *   TIDEWIRE_RANK=1 TIDEWIRE_WORLD_SIZE=2 TIDEWIRE_MASTER=127.0.0.1:29500 \
 *      TIDEWIRE_SECRET=s ./train
 *
 * Usage: train [hybrid|ps|sfb] [steps]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tidewire.h"

#define M 4          /* outputs */
#define N 16         /* inputs */
#define K 32         /* samples per worker per step */
#define TOTAL (M * N + M)
#define LAYER_W 0u
#define LAYER_B 1u

static int rank = -1;

/* Every failure ends the process with the call, the code and Tidewire's message. */
#define CHECK(call)                                                                  \
  do {                                                                               \
    int rc_ = (call);                                                                \
    if (rc_ != TW_OK) {                                                              \
      fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, #call, tw_error_name(rc_), \
              tw_last_error());                                                      \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

/* A value in [-1, 1) from a seed (splitmix64). */
static float uniform(uint64_t seed) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)(z >> 40) / (float)(1u << 23) - 1.0f;
}

static float target(int i, int j) { return (float)((i * N + j) % 7) / 4.0f - 0.75f; }

/* Sample k of a stream: x, and y = W* x + b*. */
static void sample(uint64_t stream, uint64_t step, uint64_t k, float x[N], float y[M]) {
  for (int j = 0; j < N; j++) x[j] = uniform((stream << 48) ^ (step << 24) ^ (k << 8) ^ (uint64_t)j);
  for (int i = 0; i < M; i++) {
    y[i] = 0.1f * (float)i;
    for (int j = 0; j < N; j++) y[i] += target(i, j) * x[j];
  }
}

/* Mean squared error on a held-out set every rank shares. */
static double loss(const float *p) {
  double l = 0.0;
  float x[N], y[M];
  for (int k = 0; k < 256; k++) {
    sample(9999, 0, (uint64_t)k, x, y);
    for (int i = 0; i < M; i++) {
      float e = p[M * N + i] - y[i];
      for (int j = 0; j < N; j++) e += p[i * N + j] * x[j];
      l += (double)e * e;
    }
  }
  return l / 256.0;
}

/* FNV-1a over the parameters' bytes. */
static uint64_t checksum(const float *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n * sizeof(float); i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

int main(int argc, char **argv) {
  const char *policy_name = argc > 1 ? argv[1] : "hybrid";
  int steps = argc > 2 ? atoi(argv[2]) : 50;
  int policy;
  if (strcmp(policy_name, "hybrid") == 0) {
    policy = TW_POLICY_HYBRID;
  } else if (strcmp(policy_name, "ps") == 0) {
    policy = TW_POLICY_PS;
  } else if (strcmp(policy_name, "sfb") == 0) {
    policy = TW_POLICY_SFB;
  } else {
    fprintf(stderr, "usage: %s [hybrid|ps|sfb] [steps]\n", argv[0]);
    return 2;
  }

  /* The caller's memory: W then b back to back, and their gradients. */
  static float params[TOTAL], grads[TOTAL];
  static float u[K * M], v[K * N];
  /* Only worker rank 0's initial values count: tw_init copies them everywhere. */
  const char *r = getenv("TIDEWIRE_RANK");
  float init = (r && strcmp(r, "0") != 0) ? 7.0f : 0.0f;
  for (int i = 0; i < TOTAL; i++) params[i] = init;

  tw_config *cfg = tw_config_new();
  if (!cfg) {
    fprintf(stderr, "tw_config_new: %s\n", tw_last_error());
    return 1;
  }
  CHECK(tw_config_add_layer(cfg, "w", TW_LAYER_FC, M, N));
  CHECK(tw_config_add_layer(cfg, "b", TW_LAYER_OTHER, 1, M));
  CHECK(tw_config_set_batch(cfg, K));
  CHECK(tw_config_set_apply(cfg, TW_APPLY_SGD, 0.1f, 0.5f, 0.0f));
  CHECK(tw_config_set_scheme_policy(cfg, policy));
  CHECK(tw_config_set_timeout_ms(cfg, 60000));
  /* No tw_config_set_job: the secret comes from TIDEWIRE_SECRET. */
  CHECK(tw_register(cfg, params, TOTAL, grads, TOTAL));

  tw_session *s = NULL;
  CHECK(tw_init(cfg, &s));
  tw_config_free(cfg);
  rank = tw_rank(s);
  int world = tw_world_size(s);
  if (rank < 0 || world < 0) {
    fprintf(stderr, "tw_rank/tw_world_size: %s\n", tw_last_error());
    return 1;
  }
  if (tw_is_worker(s) == 0) {
    printf("rank %d/%d: server only, serving the job\n", rank, world);
    CHECK(tw_finalize(s));
    printf("rank %d: done\n", rank);
    return 0;
  }
  for (int i = 0; i < TOTAL; i++) {
    if (params[i] != 0.0f) {
      fprintf(stderr, "rank %d: parameter %d is %g after tw_init, not rank 0's 0\n", rank, i, params[i]);
      return 1;
    }
  }
  int scheme = tw_scheme(s, LAYER_W);
  if (scheme < 0) {
    fprintf(stderr, "rank %d: tw_scheme: %s\n", rank, tw_last_error());
    return 1;
  }
  printf("rank %d/%d: transport %s, layer w syncs by %s (policy %s)\n", rank, world, tw_transport(s),
         scheme == TW_SCHEME_SFB ? "sufficient factors" : "the parameter server", policy_name);

  double before = loss(params);
  float x[N], y[M];
  for (int step = 0; step < steps; step++) {
    /* Forward and backward on this rank's batch: e = (W x + b - y) / K per
     * sample; dW = sum e x^T (= U^T V with U = e's, V = x's), db = sum e. */
    memset(grads, 0, sizeof grads);
    for (int k = 0; k < K; k++) {
      sample((uint64_t)rank + 1, (uint64_t)step, (uint64_t)k, x, y);
      for (int i = 0; i < M; i++) {
        float e = params[M * N + i] - y[i];
        for (int j = 0; j < N; j++) e += params[i * N + j] * x[j];
        e /= (float)K;
        u[k * M + i] = e;
        grads[M * N + i] += e;
        for (int j = 0; j < N; j++) grads[i * N + j] += e * x[j];
      }
      memcpy(&v[k * N], x, sizeof x);
    }
    /* Push in backward order; from here until its pull a layer is Tidewire's. */
    CHECK(tw_push(s, LAYER_B));
    if (scheme == TW_SCHEME_SFB) {
      CHECK(tw_push_factors(s, LAYER_W, u, K * M, v, K * N));
    } else {
      CHECK(tw_push(s, LAYER_W));
    }
    /* Pull in forward order: W blocking, b by polling (a framework would
     * compute meanwhile). */
    CHECK(tw_pull(s, LAYER_W));
    int done = 0;
    while (!done) CHECK(tw_poll(s, LAYER_B, &done));
    if (step % 10 == 0) printf("rank %d: step %d loss %.6g\n", rank, step, loss(params));
  }
  double after = loss(params);
  CHECK(tw_finalize(s));

  printf("rank %d: loss %.6g -> %.6g\n", rank, before, after);
  printf("rank %d: checksum %016llx\n", rank, (unsigned long long)checksum(params, TOTAL));
  if (!(after < before / 100.0)) {
    fprintf(stderr, "rank %d: the loss fell from %g to %g only\n", rank, before, after);
    return 1;
  }
  return 0;
}
