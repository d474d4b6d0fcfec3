/* The verbs floor of a connection's set-up, in C: what the kernel and libibverbs cost per
 * connection, without Python, on the device at hand. For each of N connections (both ends on
 * this device, in this process, one after another): register a buffer of SLOTS_BYTES (zeroed,
 * as aiordma's slots are), create two RC queue pairs on one shared CQ, post RECVS receives on
 * each once in INIT, and take both to RTR and RTS, connected to each other. Prints the time per
 * connection of each step (both ends together: one end's share is half) in CPU and wall time.
 *
 * Build and run (the private rdma-core prefix that `make setup` builds; in the VM):
 *   cc -O2 -o build/setup_floor scripts/setup_floor.c -I$PREFIX/include -L$PREFIX/lib \
 *      -libverbs -Wl,-rpath,$PREFIX/lib
 *   build/setup_floor DEVICE GID_INDEX [N]
 */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SLOTS_BYTES (136 * 8192) /* 72 receive + 64 send slots of 8 KiB: aiordma's default */
#define RECVS 72
#define STEPS 6

static const char *names[STEPS] = {"register the slots (zeroed)", "create two queue pairs",
                                   "post the receives (in INIT)", "RESET -> INIT",
                                   "INIT -> RTR", "RTR -> RTS"};
static double wall[STEPS], cpu[STEPS];

static double now(clockid_t c) {
    struct timespec t;
    clock_gettime(c, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static double w0, c0;
static void start(void) { w0 = now(CLOCK_MONOTONIC); c0 = now(CLOCK_PROCESS_CPUTIME_ID); }
static void stop(int step) {
    wall[step] += now(CLOCK_MONOTONIC) - w0;
    cpu[step] += now(CLOCK_PROCESS_CPUTIME_ID) - c0;
}

static void die(const char *what) { perror(what); exit(1); }

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s DEVICE GID_INDEX [N]\n", argv[0]);
        return 2;
    }
    int gid_index = atoi(argv[2]), n = argc > 3 ? atoi(argv[3]) : 64;
    struct ibv_device **list = ibv_get_device_list(NULL);
    struct ibv_context *ctx = NULL;
    for (int i = 0; list && list[i]; i++)
        if (!strcmp(ibv_get_device_name(list[i]), argv[1])) ctx = ibv_open_device(list[i]);
    if (!ctx) die("open device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 4096, NULL, NULL, 0);
    union ibv_gid gid;
    struct ibv_port_attr port;
    if (!pd || !cq || ibv_query_gid(ctx, 1, gid_index, &gid) || ibv_query_port(ctx, 1, &port))
        die("pd, cq, gid or port");
    struct ibv_qp **qps = calloc(2 * n, sizeof *qps);
    struct ibv_mr **mrs = calloc(n, sizeof *mrs);
    for (int c = 0; c < n; c++) {
        start();
        char *buf = calloc(1, SLOTS_BYTES);
        mrs[c] = ibv_reg_mr(pd, buf, SLOTS_BYTES, IBV_ACCESS_LOCAL_WRITE);
        if (!mrs[c]) die("ibv_reg_mr");
        stop(0);
        start();
        for (int s = 0; s < 2; s++) {
            struct ibv_qp_init_attr a = {.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                         .cap = {.max_send_wr = 64, .max_recv_wr = RECVS,
                                                 .max_send_sge = 1, .max_recv_sge = 1}};
            if (!(qps[2 * c + s] = ibv_create_qp(pd, &a))) die("ibv_create_qp");
        }
        stop(1);
        start();
        for (int s = 0; s < 2; s++) {
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
                                    .qp_access_flags = IBV_ACCESS_REMOTE_READ |
                                                       IBV_ACCESS_REMOTE_WRITE};
            if (ibv_modify_qp(qps[2 * c + s], &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX |
                              IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) die("INIT");
        }
        stop(3);
        start();
        for (int s = 0; s < 2; s++)
            for (int r = 0; r < RECVS; r++) {
                struct ibv_sge sge = {(uintptr_t)buf + r * 8192, 8192, mrs[c]->lkey};
                struct ibv_recv_wr wr = {.wr_id = r, .sg_list = &sge, .num_sge = 1}, *bad;
                int err = ibv_post_recv(qps[2 * c + s], &wr, &bad);
                if (err) {
                    fprintf(stderr, "ibv_post_recv: %s\n", strerror(err));
                    return 1;
                }
            }
        stop(2);
        start();
        for (int s = 0; s < 2; s++) {
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = port.active_mtu,
                                    .dest_qp_num = qps[2 * c + 1 - s]->qp_num, .rq_psn = 0,
                                    .max_dest_rd_atomic = 16, .min_rnr_timer = 12,
                                    .ah_attr = {.is_global = 1, .port_num = 1,
                                                .grh = {.dgid = gid, .sgid_index = gid_index,
                                                        .hop_limit = 64}}};
            if (ibv_modify_qp(qps[2 * c + s], &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                              IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                              IBV_QP_MIN_RNR_TIMER)) die("RTR");
        }
        stop(4);
        start();
        for (int s = 0; s < 2; s++) {
            struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
                                    .rnr_retry = 7, .sq_psn = 0, .max_rd_atomic = 16};
            if (ibv_modify_qp(qps[2 * c + s], &a, IBV_QP_STATE | IBV_QP_TIMEOUT |
                              IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                              IBV_QP_MAX_QP_RD_ATOMIC)) die("RTS");
        }
        stop(5);
    }
    double tw = 0, tc = 0;
    printf("%d connections on %s (both ends in this process), ms per connection:\n", n, argv[1]);
    for (int s = 0; s < STEPS; s++) {
        printf("  %-30s cpu %7.3f  wall %7.3f\n", names[s], cpu[s] / n * 1e3, wall[s] / n * 1e3);
        tw += wall[s];
        tc += cpu[s];
    }
    printf("  %-30s cpu %7.3f  wall %7.3f  (%.0f connections/s)\n", "in all", tc / n * 1e3,
           tw / n * 1e3, n / tw);
    for (int i = 0; i < 2 * n; i++) ibv_destroy_qp(qps[i]);
    for (int i = 0; i < n; i++) ibv_dereg_mr(mrs[i]);
    ibv_destroy_cq(cq);
    ibv_dealloc_pd(pd);
    ibv_close_device(ctx);
    ibv_free_device_list(list);
    return 0;
}
