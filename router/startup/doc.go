// Package startup is the tunnel router's start-up: its flags, the kernel
// check, the wiring of the kernel seams, the controller, BGP, metrics and
// health, and --cleanup. cmd/tunnel-router calls Main.
package startup
