// Package bgp announces the tunnel IPs a tunnel router serves to the
// datacenter's routers, with an embedded GoBGP speaker. Each served tunnel IP
// is announced as a host prefix (/32 or /128) with this node's address of the
// tunnel IP's family as the next hop, so that the peers spread its traffic
// over every healthy tunnel router (ECMP).
package bgp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/sirupsen/logrus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

// Defaults of the configuration file.
const (
	DefaultHoldTime      = 90 * time.Second
	DefaultConnectRetry  = 5 * time.Second
	DefaultWithdrawDelay = 2 * time.Second
	DefaultRestartTime   = 120 * time.Second
	// DefaultBFDInterval is the BFD transmit and receive interval; with the
	// default multiplier a dead peer is detected in 900 ms.
	DefaultBFDInterval   = 300 * time.Millisecond
	DefaultBFDMultiplier = 3
	// DefaultMaxPrefixes bounds what a peer may send, per address family:
	// the router imports no route (it only announces its tunnel IPs), but
	// GoBGP keeps every received route in the peer's Adj-RIB-In, so a peer
	// sending a full table, or a flood, would grow the router's memory
	// without a limit.
	DefaultMaxPrefixes = 1000
)

// Config is the BGP part of the configuration every tunnel router shares,
// read from a YAML (or JSON) file, usually mounted from the ConfigMap.
type Config struct {
	// ASN is the local autonomous system number of every router (required).
	ASN uint32 `json:"asn"`
	// RouterID is the BGP identifier, an IPv4 address; empty means the
	// node's IPv4 address.
	RouterID string `json:"routerID,omitempty"`
	// NextHop is the next hop announced for every IPv4 tunnel IP, an IPv4
	// address; empty means the node's IPv4 address (its first InternalIP,
	// else ExternalIP).
	NextHop string `json:"nextHop,omitempty"`
	// NextHopIPv6 is the next hop announced for every IPv6 tunnel IP, an
	// IPv6 address; empty means the node's IPv6 address (its first
	// InternalIP, else ExternalIP). With neither, IPv6 tunnel IPs are not
	// announced (the IPv4 ones still are).
	NextHopIPv6 string `json:"nextHopIPv6,omitempty"`
	// ListenPort is the TCP port on which the router accepts sessions. 0
	// (the default) means it does not listen and only connects out, so that
	// it never competes with another BGP daemon of the node (a CNI's) for
	// port 179; peers then must be allowed to be connected to.
	ListenPort int32 `json:"listenPort,omitempty"`
	// WithdrawDelay is how long the router waits, on SIGTERM, between
	// withdrawing its announcements and closing its sessions.
	WithdrawDelay *metav1.Duration `json:"withdrawDelay,omitempty"`
	// GracefulRestart enables BGP graceful restart (RFC 4724) with every
	// peer: when the router dies without withdrawing (crash, OOM kill), its
	// peers keep its routes for RestartTime while the kernel datapath keeps
	// forwarding, and the restarted router re-announces them.
	GracefulRestart *GracefulRestart `json:"gracefulRestart,omitempty"`
	// Peers are the BGP neighbours.
	Peers []Peer `json:"peers"`
}

// GracefulRestart configures graceful restart.
type GracefulRestart struct {
	Enabled bool `json:"enabled"`
	// RestartTime is how long peers keep the routes of a router that went
	// away without a notification (default 120s, at most 4095s).
	RestartTime *metav1.Duration `json:"restartTime,omitempty"`
}

// Peer is one BGP neighbour.
type Peer struct {
	// Address is the neighbour's IP address (required).
	Address string `json:"address"`
	// ASN is the neighbour's autonomous system number (required).
	ASN uint32 `json:"asn"`
	// LocalASN overrides Config.ASN for this neighbour.
	LocalASN uint32 `json:"localASN,omitempty"`
	// Port is the neighbour's TCP port (default 179).
	Port uint16 `json:"port,omitempty"`
	// SourceAddress is the local address of the session; empty lets the
	// kernel choose.
	SourceAddress string `json:"sourceAddress,omitempty"`
	// Password enables TCP MD5 signatures (RFC 2385) with this password.
	Password string `json:"password,omitempty"`
	// PasswordFile reads the password from a file (a mounted Secret), so
	// that it need not be in the ConfigMap. It wins over Password.
	PasswordFile string `json:"passwordFile,omitempty"`
	// HoldTime is the proposed hold time (default 90s; 0 or at least 3s).
	HoldTime *metav1.Duration `json:"holdTime,omitempty"`
	// KeepaliveTime is the keepalive interval (default a third of the hold time).
	KeepaliveTime *metav1.Duration `json:"keepaliveTime,omitempty"`
	// ConnectRetry is the time between connection attempts (default 5s,
	// jittered by GoBGP to 75-100%).
	ConnectRetry *metav1.Duration `json:"connectRetry,omitempty"`
	// EBGPMultihop is the TTL of eBGP packets towards a neighbour that is not
	// directly connected (0: directly connected, TTL 1).
	EBGPMultihop uint8 `json:"ebgpMultihop,omitempty"`
	// BFD enables GoBGP's single-hop BFD (RFC 5880/5881) with this
	// neighbour, which must run BFD too.
	BFD *BFD `json:"bfd,omitempty"`
	// NodeSelector limits the neighbour to the routers whose Node matches
	// (for example a top-of-rack router per rack). Empty: every router.
	NodeSelector *metav1.LabelSelector `json:"nodeSelector,omitempty"`
	// MaxPrefixes is how many routes of one address family the neighbour
	// may send before the router closes the session (a Cease, "maximum
	// number of prefixes reached") and keeps it down until its
	// configuration changes or the router restarts. The router imports
	// none of them either way. Default 1000; 0 means no limit.
	MaxPrefixes *uint32 `json:"maxPrefixes,omitempty"`
}

// maxPrefixes is the peer's limit per address family (0: none).
func (p *Peer) maxPrefixes() uint32 {
	if p.MaxPrefixes == nil {
		return DefaultMaxPrefixes
	}
	return *p.MaxPrefixes
}

// BFD configures Bidirectional Forwarding Detection towards one neighbour.
type BFD struct {
	// MinInterval is both the desired transmit and the required receive
	// interval (default 300ms).
	MinInterval *metav1.Duration `json:"minInterval,omitempty"`
	// Multiplier is the number of missed packets that declares the
	// neighbour down (default 3).
	Multiplier uint32 `json:"multiplier,omitempty"`
}

// Load reads and validates a configuration file. Unknown fields are errors,
// so that a misspelt option is not silently ignored.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading BGP configuration: %w", err)
	}
	cfg, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("BGP configuration %s: %w", path, err)
	}
	return cfg, nil
}

// Parse decodes and validates a configuration.
func Parse(data []byte) (*Config, error) {
	var cfg Config
	if err := yaml.UnmarshalStrict(data, &cfg); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &cfg, nil
}

// Validate checks every field and names the first wrong one.
func (c *Config) Validate() error {
	var errs []error
	field := func(name, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{name}, args...)...))
	}
	if c.ASN == 0 {
		field("asn", "must be set")
	}
	if c.RouterID != "" {
		if a, err := netip.ParseAddr(c.RouterID); err != nil || !a.Is4() {
			field("routerID", "%q is not an IPv4 address", c.RouterID)
		}
	}
	if c.NextHop != "" {
		if a, err := netip.ParseAddr(c.NextHop); err != nil || !a.Is4() {
			field("nextHop", "%q is not an IPv4 address (the next hop of IPv6 tunnel IPs is nextHopIPv6)", c.NextHop)
		}
	}
	if c.NextHopIPv6 != "" {
		if a, err := netip.ParseAddr(c.NextHopIPv6); err != nil || !usableIPv6NextHop(a) {
			field("nextHopIPv6", "%q is not a global IPv6 address (the next hop of IPv4 tunnel IPs is nextHop)", c.NextHopIPv6)
		}
	}
	if c.ListenPort < 0 || c.ListenPort > 65535 {
		field("listenPort", "%d is not a TCP port", c.ListenPort)
	}
	if d := c.WithdrawDelay; d != nil && d.Duration < 0 {
		field("withdrawDelay", "must not be negative")
	}
	if gr := c.GracefulRestart; gr != nil && gr.RestartTime != nil {
		if t := gr.RestartTime.Duration; t < time.Second || t > 4095*time.Second {
			field("gracefulRestart.restartTime", "%v is outside 1s..4095s", t)
		}
	}
	if len(c.Peers) == 0 {
		field("peers", "at least one peer is needed")
	}
	seen := map[netip.Addr]int{}
	for i, p := range c.Peers {
		name := fmt.Sprintf("peers[%d]", i)
		addr, err := netip.ParseAddr(p.Address)
		switch {
		case err != nil:
			field(name+".address", "%q is not an IP address", p.Address)
		case seen[addr] > 0:
			field(name+".address", "%v is also peers[%d]", addr, seen[addr]-1)
		default:
			seen[addr] = i + 1
		}
		if p.ASN == 0 {
			field(name+".asn", "must be set")
		}
		if p.SourceAddress != "" {
			if _, err := netip.ParseAddr(p.SourceAddress); err != nil {
				field(name+".sourceAddress", "%q is not an IP address", p.SourceAddress)
			}
		}
		hold := p.holdTime()
		if hold != 0 && hold < 3*time.Second {
			field(name+".holdTime", "%v: must be 0 or at least 3s (RFC 4271)", hold)
		}
		if hold%time.Second != 0 {
			field(name+".holdTime", "%v: must be whole seconds", hold)
		}
		if k := p.KeepaliveTime; k != nil {
			if k.Duration < time.Second || k.Duration%time.Second != 0 || (hold != 0 && k.Duration >= hold) {
				field(name+".keepaliveTime", "%v: must be whole seconds, at least 1s and below the hold time", k.Duration)
			}
		}
		if r := p.ConnectRetry; r != nil && r.Duration < time.Second {
			field(name+".connectRetry", "%v: must be at least 1s", r.Duration)
		}
		if b := p.BFD; b != nil && b.MinInterval != nil && b.MinInterval.Duration < 10*time.Millisecond {
			field(name+".bfd.minInterval", "%v: must be at least 10ms", b.MinInterval.Duration)
		}
		if p.NodeSelector != nil {
			if _, err := metav1.LabelSelectorAsSelector(p.NodeSelector); err != nil {
				field(name+".nodeSelector", "%v", err)
			}
		}
		if p.PasswordFile != "" {
			if _, err := os.Stat(p.PasswordFile); err != nil {
				field(name+".passwordFile", "%v", err)
			}
		}
	}
	return errors.Join(errs...)
}

// usableIPv6NextHop reports whether a can be the next hop of IPv6 tunnel
// IPs: an IPv6 address that is not IPv4-mapped, link-local (it would need
// a zone, which BGP does not carry alone), multicast or unspecified.
func usableIPv6NextHop(a netip.Addr) bool {
	return a.Is6() && !a.Is4In6() && a.Zone() == "" && !a.IsLinkLocalUnicast() && !a.IsMulticast() && !a.IsUnspecified()
}

// WithdrawWait is how long to wait between withdrawing and closing.
func (c *Config) WithdrawWait() time.Duration {
	if c.WithdrawDelay == nil {
		return DefaultWithdrawDelay
	}
	return c.WithdrawDelay.Duration
}

func (p *Peer) holdTime() time.Duration {
	if p.HoldTime == nil {
		return DefaultHoldTime
	}
	return p.HoldTime.Duration
}

// password returns the session's TCP MD5 password.
func (p *Peer) password() (string, error) {
	if p.PasswordFile == "" {
		return p.Password, nil
	}
	data, err := os.ReadFile(p.PasswordFile)
	if err != nil {
		return "", fmt.Errorf("peer %s: passwordFile: %w", p.Address, err)
	}
	return strings.TrimRight(string(data), "\r\n"), nil
}

// Selects reports whether the peer applies to a node with these labels.
func (p *Peer) Selects(nodeLabels map[string]string) bool {
	if p.NodeSelector == nil {
		return true
	}
	sel, err := metav1.LabelSelectorAsSelector(p.NodeSelector)
	if err != nil {
		return false // rejected by Validate
	}
	return sel.Matches(labels.Set(nodeLabels))
}

// ConfigWatchPeriod is how often WatchFile reads the configuration file.
// kubelet itself refreshes a mounted ConfigMap within about a minute.
const ConfigWatchPeriod = 5 * time.Second

// WatchFile reads path every period until ctx ends and hands each new
// valid configuration to apply (the speaker's SetConfig). A file that
// does not parse or validate is logged, naming the file and the field,
// once per content, and the running configuration stays.
func WatchFile(ctx context.Context, path string, period time.Duration, apply func(Config), log logrus.FieldLogger) {
	last, _ := os.ReadFile(path)
	ticker := time.NewTicker(period)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		data, err := os.ReadFile(path)
		if err != nil || bytes.Equal(data, last) {
			continue
		}
		last = data
		cfg, err := Parse(data)
		if err != nil {
			log.WithError(err).WithField("file", path).Error("BGP configuration not changed: the new file is refused")
			continue
		}
		log.WithField("file", path).Info("BGP configuration file changed: applying it")
		apply(*cfg)
	}
}
