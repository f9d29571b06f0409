/* no-uring: runs a command with io_uring denied by a seccomp filter, as Docker's
 * default profile (since moby/moby#46762) and containerd's RuntimeDefault do:
 * io_uring_setup, io_uring_enter and io_uring_register fail with EPERM in the
 * command and in every process it starts. Nothing else on the machine is
 * affected (unlike kernel.io_uring_disabled).
 *
 * Build: cc -O2 -o no-uring ci/no-uring.c     Usage: no-uring COMMAND [ARG...]
 */
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

/* The io_uring syscalls share their numbers on every architecture that has them
 * (asm-generic numbering, since Linux 5.1). */
#define NR_IO_URING_SETUP 425
#define NR_IO_URING_ENTER 426
#define NR_IO_URING_REGISTER 427

#if defined(__x86_64__)
#define ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define ARCH AUDIT_ARCH_AARCH64
#else
#error "no-uring: unknown architecture"
#endif

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s COMMAND [ARG...]\n", argv[0]);
        return 2;
    }
    struct sock_filter filter[] = {
        /* Another ABI (x32, i386 on x86-64): numbers differ; deny nothing there. */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_IO_URING_SETUP, 3, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_IO_URING_ENTER, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, NR_IO_URING_REGISTER, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
    };
    struct sock_fprog prog = {
        .len = (unsigned short)(sizeof(filter) / sizeof(filter[0])),
        .filter = filter,
    };
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        fprintf(stderr, "no-uring: PR_SET_NO_NEW_PRIVS: %s\n", strerror(errno));
        return 1;
    }
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        fprintf(stderr, "no-uring: installing the seccomp filter: %s\n", strerror(errno));
        return 1;
    }
    execvp(argv[1], argv + 1);
    fprintf(stderr, "no-uring: exec %s: %s\n", argv[1], strerror(errno));
    return 127;
}
