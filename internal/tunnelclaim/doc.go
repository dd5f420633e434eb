// Package tunnelclaim decides which Service a tunnel IP belongs to: the
// cmd.nu/tunnel annotation's syntax, the address pools that admit or refuse
// a tunnel IP (Pools.Admit), and the order that resolves two Services
// claiming one IP. The router and the endpoint agent both use it, so every
// daemon in the cluster reaches the same decision.
package tunnelclaim
