/* LD_PRELOAD shim: wildcard binds become loopback binds.
 *
 * Mooncake's transfer engine (its RPC listener and its TCP transport) binds 0.0.0.0 / :: with no
 * option to choose the address; MC_TCP_BIND_ADDRESS only sets the address it advertises.  In a
 * process started with this library preloaded (cache/loopback.py builds it and sets the
 * environment), bind() to INADDR_ANY binds 127.0.0.1, and bind() to in6addr_any binds the
 * v4-mapped loopback ::ffff:127.0.0.1 on a dual-stack socket (127.0.0.1 clients still connect)
 * or ::1 on a v6-only one (so a dual-stack listener takes 127.0.0.1 clients, not [::1] ones).
 * Not covered: listen() on a never-bound socket (the kernel picks the wildcard itself) and
 * statically linked programs.  Ports listed in KIMIK3_BIND_ANY_PORTS (comma-separated) keep the
 * wildcard: a public port the operator asked for.  Every other bind() is passed through as is.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int port_allowed(unsigned short port) {
    const char *list = getenv("KIMIK3_BIND_ANY_PORTS");
    if (!list || !port) return 0;
    while (*list) {
        char *end;
        long p = strtol(list, &end, 10);
        if (end == list) return 0;
        if (p == port) return 1;
        list = (*end == ',') ? end + 1 : end;
        if (*end && *end != ',') return 0;
    }
    return 0;
}

static bind_fn real_bind;

__attribute__((constructor)) static void find_real_bind(void) {
    real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");  /* before any thread of the process runs */
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    if (!real_bind) find_real_bind();  /* a bind() from another library's constructor, before ours */
    if (!real_bind) {
        errno = ENOSYS;
        return -1;
    }
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY) && !port_allowed(ntohs(a.sin_port))) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (IN6_IS_ADDR_UNSPECIFIED(&a.sin6_addr) && !port_allowed(ntohs(a.sin6_port))) {
            int v6only = 0;
            socklen_t n = sizeof v6only;
            if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &n) != 0) v6only = 0;
            if (v6only) {
                a.sin6_addr = in6addr_loopback;
            } else {
                memset(&a.sin6_addr, 0, sizeof a.sin6_addr);
                a.sin6_addr.s6_addr[10] = 0xff;
                a.sin6_addr.s6_addr[11] = 0xff;
                a.sin6_addr.s6_addr[12] = 127;
                a.sin6_addr.s6_addr[15] = 1;
            }
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
