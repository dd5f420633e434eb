// Package runtime will find a pod's network namespace through Docker, the CRI
// API or a runtime-free lookup by pod IP, for the endpoint agent. It is not
// built yet (see README.md, Status).
package runtime
