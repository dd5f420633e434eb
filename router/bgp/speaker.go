package bgp

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/osrg/gobgp/v4/api"
	"github.com/osrg/gobgp/v4/pkg/apiutil"
	"github.com/osrg/gobgp/v4/pkg/packet/bgp"
	"github.com/osrg/gobgp/v4/pkg/server"
	"github.com/sirupsen/logrus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// Node is what the speaker needs to know of the node it runs on.
type Node struct {
	Name string
	// Address is the node's IPv4 address: the default router ID and next
	// hop of IPv4 tunnel IPs.
	Address netip.Addr
	// AddressIPv6 is the node's IPv6 address: the default next hop of IPv6
	// tunnel IPs.
	AddressIPv6 netip.Addr
	// Labels select the peers (Peer.NodeSelector).
	Labels map[string]string
}

// Speaker announces a set of tunnel IPs to the configured peers. Announce and
// SetNode only record what is wanted and never block; Run's goroutine talks
// to GoBGP, so that a slow or failing peer never holds up the datapath.
//
// The speaker opens no session before it has both its Node and a first
// Announce: the controller announces only after its first full sync, so that
// a restarted router never announces a partial set (with graceful restart,
// the peers replace the stale routes by exactly the new set).
type Speaker struct {
	cfg     Config
	log     logrus.FieldLogger
	metrics *Metrics
	server  *server.BgpServer

	mu        sync.Mutex
	pending   *Config // a new configuration for Run to apply (SetConfig)
	desired   map[netip.Addr]bool
	announces bool // Announce was called at least once
	node      *Node
	kick      chan struct{}

	// Owned by Run's goroutine.
	started   bool
	routerID  netip.Addr
	hops      NextHops
	announced map[netip.Addr]netip.Addr // tunnel IP -> the next hop it is announced with
	peers     map[netip.Addr]Peer
	// unrouted is, per family ("IPv4", "IPv6"), whether wanted tunnel IPs
	// are left unannounced for want of a next hop (logged once per change).
	unrouted map[string]bool
}

// NewSpeaker returns a speaker for a validated configuration.
func NewSpeaker(cfg Config, log logrus.FieldLogger, metrics *Metrics) *Speaker {
	if metrics == nil {
		metrics = NewMetrics(nil)
	}
	return &Speaker{
		cfg:       cfg,
		log:       log,
		metrics:   metrics,
		server:    server.NewBgpServer(server.LoggerOption(gobgpLogger(log))),
		desired:   map[netip.Addr]bool{},
		kick:      make(chan struct{}, 1),
		announced: map[netip.Addr]netip.Addr{},
		peers:     map[netip.Addr]Peer{},
		unrouted:  map[string]bool{},
	}
}

// Announce replaces the set of tunnel IPs to announce.
func (s *Speaker) Announce(vips []netip.Addr) {
	want := make(map[netip.Addr]bool, len(vips))
	for _, v := range vips {
		want[v] = true
	}
	s.mu.Lock()
	s.desired, s.announces = want, true
	s.mu.Unlock()
	s.poke()
}

// SetConfig hands the speaker a new validated configuration, applied by
// Run without a restart of the router: peers added, removed, or (when their
// settings changed) reset one by one; a new nextHop or nextHopIPv6
// re-announces the tunnel IPs of its family with it; a change of the
// speaker's own settings (asn, routerID, listenPort, gracefulRestart)
// restarts BGP, closing every session, as a router restart would.
// withdrawDelay applies at the next exit.
func (s *Speaker) SetConfig(cfg Config) {
	s.mu.Lock()
	s.pending = &cfg
	s.mu.Unlock()
	s.poke()
}

// SetNode records the node's addresses and labels (the peers it selects).
// A new address of a family that gives the next hop re-announces the tunnel
// IPs of that family with it; a new IPv4 address that gives the router ID
// restarts BGP, as a new routerID does.
func (s *Speaker) SetNode(n Node) {
	s.mu.Lock()
	s.node = &n
	s.mu.Unlock()
	s.poke()
}

func (s *Speaker) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Run converges GoBGP on what is wanted until ctx ends, then withdraws every
// announcement, waits Config.WithdrawDelay for the withdrawals to reach the
// peers, and closes the sessions.
func (s *Speaker) Run(ctx context.Context) {
	go s.server.Serve()
	backoff := wait.Backoff{Duration: time.Second, Factor: 2, Jitter: 0.1, Steps: 1 << 30, Cap: 30 * time.Second}
	var retry <-chan time.Time
	waiting := time.After(startWarning)
	for {
		select {
		case <-ctx.Done():
			s.shutdown()
			return
		case <-s.kick:
		case <-retry:
		case <-waiting:
			s.warnIfNotStarted()
			continue
		}
		if err := s.reconcile(); err != nil {
			s.metrics.errors.Inc()
			delay := backoff.Step()
			s.log.WithError(err).WithField("retry_in", delay.Round(time.Millisecond)).Warn("BGP speaker")
			retry = time.After(delay)
			continue
		}
		backoff.Duration, backoff.Steps, retry = time.Second, 1<<30, nil
	}
}

// startWarning is how long the speaker waits for its node and the first
// full sync before it says why it has not opened any session.
const startWarning = 30 * time.Second

func (s *Speaker) warnIfNotStarted() {
	if s.started {
		return
	}
	s.mu.Lock()
	node, announces := s.node, s.announces
	s.mu.Unlock()
	switch {
	case node == nil:
		s.log.Warnf("no BGP session yet after %v: this router's Node has not been seen (check --node-name / NODE_NAME)", startWarning)
	case !announces:
		s.log.Warnf("no BGP session yet after %v: waiting for the router's first full sync of the datapath", startWarning)
	}
}

func (s *Speaker) reconcile() error {
	s.mu.Lock()
	desired, announces, node, pending := maps.Clone(s.desired), s.announces, s.node, s.pending
	s.pending = nil
	s.mu.Unlock()
	if pending != nil {
		if err := s.applyConfig(*pending); err != nil {
			s.mu.Lock()
			if s.pending == nil {
				s.pending = pending // retried with the next reconcile
			}
			s.mu.Unlock()
			return err
		}
	}
	if node == nil || !announces {
		return nil // not before the node and the first full sync are known
	}
	if s.started {
		if id := routerIDFor(s.cfg, *node); id.Is4() && id != s.routerID {
			// GoBGP takes its router ID at start only.
			if err := s.stop(logrus.Fields{"router_id": id, "was": s.routerID}, "the node's IPv4 address, the router ID, changed"); err != nil {
				return err
			}
		}
	}
	if !s.started {
		if err := s.start(*node); err != nil {
			return err
		}
	}
	s.setNextHops(*node)
	// Paths before peers: a new session's first update carries the whole set.
	if err := s.syncPaths(desired, node.Name); err != nil {
		return err
	}
	return s.syncPeers(*node)
}

// routerIDFor is the configured routerID, else the node's IPv4 address.
func routerIDFor(cfg Config, node Node) netip.Addr {
	if cfg.RouterID != "" {
		return netip.MustParseAddr(cfg.RouterID)
	}
	return node.Address
}

// setNextHops takes the next hops of the configuration and node, and logs
// those that changed.
func (s *Speaker) setNextHops(node Node) {
	hops := NextHopsFor(s.cfg, node)
	for _, f := range []struct {
		family    string
		old, next netip.Addr
	}{{"IPv4", s.hops.IPv4, hops.IPv4}, {"IPv6", s.hops.IPv6, hops.IPv6}} {
		if f.old != f.next && f.old.IsValid() {
			s.log.WithFields(logrus.Fields{"family": f.family, "next_hop": f.next, "was": f.old}).
				Info("next hop of the family's tunnel IPs changed: re-announcing them")
		}
	}
	s.hops = hops
}

func (s *Speaker) start(node Node) error {
	routerID := routerIDFor(s.cfg, node)
	if !routerID.Is4() {
		return fmt.Errorf("node %s has no IPv4 address for the BGP router ID; set routerID in the BGP configuration", node.Name)
	}
	hops := NextHopsFor(s.cfg, node)
	listen := int32(-1) // GoBGP: do not listen
	if s.cfg.ListenPort > 0 {
		listen = s.cfg.ListenPort
	}
	global := &api.Global{Asn: s.cfg.ASN, RouterId: routerID.String(), ListenPort: listen}
	if err := s.server.StartBgp(context.Background(), &api.StartBgpRequest{Global: global}); err != nil {
		return fmt.Errorf("starting BGP (asn %d, router id %v): %w", s.cfg.ASN, routerID, err)
	}
	if err := s.server.AddPolicy(context.Background(), &api.AddPolicyRequest{Policy: ownRoutesOnly()}); err != nil {
		return fmt.Errorf("adding the BGP policy %s: %w", ownRoutesPolicy, err)
	}
	for _, dir := range []api.PolicyDirection{api.PolicyDirection_POLICY_DIRECTION_IMPORT, api.PolicyDirection_POLICY_DIRECTION_EXPORT} {
		if err := s.server.SetPolicyAssignment(context.Background(), &api.SetPolicyAssignmentRequest{Assignment: &api.PolicyAssignment{
			Name: "global", Direction: dir, Policies: []*api.Policy{{Name: ownRoutesPolicy}}, DefaultAction: api.RouteAction_ROUTE_ACTION_REJECT,
		}}); err != nil {
			return fmt.Errorf("assigning the BGP policy %s (%v): %w", ownRoutesPolicy, dir, err)
		}
	}
	if err := s.server.WatchEvent(context.Background(), server.WatchEventMessageCallbacks{OnPeerUpdate: s.peerEvent}, server.WatchPeer()); err != nil {
		return fmt.Errorf("watching BGP peers: %w", err)
	}
	s.started, s.routerID, s.hops = true, routerID, hops
	s.log.WithFields(logrus.Fields{"asn": s.cfg.ASN, "router_id": routerID, "next_hop": hops.IPv4, "next_hop_ipv6": hops.IPv6,
		"listen_port": s.cfg.ListenPort, "graceful_restart": s.gracefulRestart()}).Info("BGP speaker started")
	return nil
}

// ownRoutesPolicy names the policy that admits only the router's own
// routes (its tunnel IPs) into its RIB and out to its peers.
const ownRoutesPolicy = "kst-own-routes-only"

// ownRoutesOnly is the router's import and export policy: a route the
// router originated is accepted; everything else falls to the default,
// reject. The router thus learns nothing from its peers and is never a
// transit between them: a route from one datacenter router is not
// re-advertised to another (GoBGP, like any BGP speaker, would by
// default). GoBGP applies the global import policy to local routes too,
// hence the statement.
func ownRoutesOnly() *api.Policy {
	return &api.Policy{Name: ownRoutesPolicy, Statements: []*api.Statement{{
		Name:       ownRoutesPolicy + "-local",
		Conditions: &api.Conditions{RouteType: api.Conditions_ROUTE_TYPE_LOCAL},
		Actions:    &api.Actions{RouteAction: api.RouteAction_ROUTE_ACTION_ACCEPT},
	}}}
}

// applyConfig makes cfg the speaker's configuration. A change of its own
// settings stops BGP (the next reconcile starts it with cfg); a change of
// the peers is left to syncPeers.
func (s *Speaker) applyConfig(cfg Config) error {
	old := s.cfg
	s.cfg = cfg
	if !s.started {
		return nil
	}
	if old.ASN == cfg.ASN && old.RouterID == cfg.RouterID && old.ListenPort == cfg.ListenPort &&
		reflect.DeepEqual(old.GracefulRestart, cfg.GracefulRestart) {
		s.log.Info("BGP configuration changed: updating the peers and next hops")
		return nil
	}
	err := s.stop(logrus.Fields{"asn": cfg.ASN, "router_id": cfg.RouterID, "listen_port": cfg.ListenPort},
		"the BGP configuration changed the speaker's own settings")
	if err != nil {
		s.cfg = old
	}
	return err
}

// stop stops BGP, closing every session, so that the next reconcile starts
// it again with the current configuration and node.
func (s *Speaker) stop(fields logrus.Fields, why string) error {
	s.log.WithFields(fields).Warn(why + ": restarting BGP, every session closes and reopens")
	if err := s.server.StopBgp(context.Background(), &api.StopBgpRequest{}); err != nil {
		return fmt.Errorf("stopping BGP to restart it (%s): %w", why, err)
	}
	for addr := range s.peers {
		s.metrics.sessionUp.DeleteLabelValues(addr.String())
	}
	// A stopped GoBGP server does not start again: the next reconcile
	// starts a new one.
	s.server = server.NewBgpServer(server.LoggerOption(gobgpLogger(s.log)))
	go s.server.Serve()
	s.started, s.peers, s.announced = false, map[netip.Addr]Peer{}, map[netip.Addr]netip.Addr{}
	s.metrics.announced.Set(0)
	return nil
}

func (s *Speaker) gracefulRestart() bool {
	return s.cfg.GracefulRestart != nil && s.cfg.GracefulRestart.Enabled
}

// peerEvent logs session changes and keeps the session metrics.
func (s *Speaker) peerEvent(ev *apiutil.WatchEventMessage_PeerEvent, _ time.Time) {
	if ev.Type != apiutil.PEER_EVENT_STATE {
		return
	}
	peer := ev.Peer.State.NeighborAddress.String()
	state := strings.TrimPrefix(strings.ToLower(ev.Peer.State.SessionState.String()), "bgp_fsm_")
	up := 0.0
	if ev.Peer.State.SessionState == bgp.BGP_FSM_ESTABLISHED {
		up = 1
	}
	s.metrics.sessionUp.WithLabelValues(peer).Set(up)
	s.metrics.transitions.WithLabelValues(peer, state).Inc()
	entry := s.log.WithFields(logrus.Fields{"peer": peer, "peer_asn": ev.Peer.State.PeerASN, "state": state})
	if msg := ev.Peer.State.DisconnectMessage; msg != "" && up == 0 {
		entry = entry.WithField("reason", msg)
	}
	if ev.Peer.State.AdminState == api.PeerState_ADMIN_STATE_PFX_CT && up == 0 {
		s.metrics.prefixLimit.WithLabelValues(peer).Inc()
		entry.WithField("field", "peers[].maxPrefixes").Error("BGP session closed: the peer sent more routes than its maxPrefixes; " +
			"the router imports none and announces nothing to this peer until its configuration changes or the router restarts: filter what the peer sends, or raise maxPrefixes")
		return
	}
	entry.Info("BGP session state")
}

func (s *Speaker) syncPaths(desired map[netip.Addr]bool, node string) error {
	plan := Plan(desired, s.hops, s.announced)
	s.logUnrouted(plan.Unrouted, node)
	var errs []error
	for _, a := range plan.Announce {
		p, err := path(a.VIP, a.NextHop)
		if err == nil {
			_, err = s.server.AddPath(apiutil.AddPathRequest{Paths: []*apiutil.Path{p}})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("announcing %v: %w", a.VIP, err))
			continue
		}
		s.announced[a.VIP] = a.NextHop
		s.metrics.updates.WithLabelValues("announce").Inc()
		s.log.WithFields(logrus.Fields{"vip": a.VIP, "next_hop": a.NextHop}).Info("announcing tunnel IP")
	}
	for _, vip := range plan.Withdraw {
		p, err := path(vip, s.announced[vip])
		if err == nil {
			err = s.server.DeletePath(apiutil.DeletePathRequest{Paths: []*apiutil.Path{p}})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("withdrawing %v: %w", vip, err))
			continue
		}
		delete(s.announced, vip)
		s.metrics.updates.WithLabelValues("withdraw").Inc()
		s.log.WithField("vip", vip).Info("withdrew tunnel IP")
	}
	s.metrics.announced.Set(float64(len(s.announced)))
	return errors.Join(errs...)
}

// logUnrouted says, once each time it starts and stops, that the wanted
// tunnel IPs of a family are not announced for want of a next hop, and
// what to set. Retrying would not help: a new node address or
// configuration reconciles again.
func (s *Speaker) logUnrouted(unrouted []netip.Addr, node string) {
	count := map[string]int{}
	example := map[string]netip.Addr{}
	for _, vip := range unrouted {
		f := familyName(vip)
		if count[f] == 0 {
			example[f] = vip
		}
		count[f]++
	}
	for _, f := range []string{"IPv4", "IPv6"} {
		now := count[f] > 0
		switch {
		case now && !s.unrouted[f]:
			s.log.WithError(missingNextHop(example[f], node)).WithFields(logrus.Fields{"family": f, "tunnel_ips": count[f], "vip": example[f]}).
				Error("tunnel IPs of this family are not announced: no next hop")
		case !now && s.unrouted[f]:
			s.log.WithField("family", f).Info("no tunnel IP of this family is left unannounced for want of a next hop any more")
		}
		s.unrouted[f] = now
	}
}

// syncPeers adds the peers that select this node and removes the others.
func (s *Speaker) syncPeers(node Node) error {
	want := map[netip.Addr]Peer{}
	for _, p := range s.cfg.Peers {
		if p.Selects(node.Labels) {
			want[netip.MustParseAddr(p.Address)] = p
		}
	}
	var errs []error
	for addr, have := range s.peers {
		if p, ok := want[addr]; ok && reflect.DeepEqual(p, have) {
			continue
		}
		if err := s.server.DeletePeer(context.Background(), &api.DeletePeerRequest{Address: addr.String()}); err != nil {
			errs = append(errs, fmt.Errorf("removing peer %v: %w", addr, err))
			continue
		}
		delete(s.peers, addr)
		s.metrics.sessionUp.DeleteLabelValues(addr.String())
		why := "its nodeSelector no longer matches this node, or the configuration dropped it"
		if _, ok := want[addr]; ok {
			why = "its settings changed: added again with the new ones"
		}
		s.log.WithFields(logrus.Fields{"peer": addr, "why": why}).Info("BGP peer removed")
	}
	for _, addr := range slices.SortedFunc(maps.Keys(want), netip.Addr.Compare) {
		if _, ok := s.peers[addr]; ok {
			continue
		}
		p := want[addr]
		conf, err := s.apiPeer(p)
		if err == nil {
			err = s.server.AddPeer(context.Background(), &api.AddPeerRequest{Peer: conf})
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("adding peer %v: %w", addr, err))
			continue
		}
		s.peers[addr] = p
		s.metrics.sessionUp.WithLabelValues(addr.String()).Set(0)
		s.log.WithFields(logrus.Fields{"peer": addr, "peer_asn": p.ASN, "hold_time": p.holdTime(), "bfd": p.BFD != nil}).Info("BGP peer added")
	}
	return errors.Join(errs...)
}

func seconds(d *metav1.Duration, def time.Duration) uint64 {
	if d == nil {
		return uint64(def / time.Second)
	}
	return uint64(d.Duration / time.Second)
}

// peerFamilies are the address families offered to a peer: IPv6 unicast to
// an IPv6 peer; IPv4 and IPv6 unicast (multiprotocol, RFC 4760) to an IPv4
// peer, so that a peer with IPv4 sessions only may take the IPv6 tunnel IPs
// too (with their IPv6 next hop) by enabling IPv6 unicast on the session.
// A family the peer does not enable is not negotiated, and not sent.
func peerFamilies(addr netip.Addr) []api.Family_Afi {
	if addr.Is6() {
		return []api.Family_Afi{api.Family_AFI_IP6}
	}
	return []api.Family_Afi{api.Family_AFI_IP, api.Family_AFI_IP6}
}

// apiPeer translates a configured peer into GoBGP's neighbour configuration.
func (s *Speaker) apiPeer(p Peer) (*api.Peer, error) {
	password, err := p.password()
	if err != nil {
		return nil, err
	}
	var afiSafis []*api.AfiSafi
	for _, afi := range peerFamilies(netip.MustParseAddr(p.Address)) {
		family := &api.Family{Afi: afi, Safi: api.Family_SAFI_UNICAST}
		a := &api.AfiSafi{Config: &api.AfiSafiConfig{Family: family, Enabled: true}}
		if limit := p.maxPrefixes(); limit > 0 {
			// GoBGP counts what the peer sent (its Adj-RIB-In), before the
			// import policy rejects it, and warns at 75 %.
			a.PrefixLimits = &api.PrefixLimit{Family: family, MaxPrefixes: limit, ShutdownThresholdPct: 75}
		}
		afiSafis = append(afiSafis, a)
	}
	hold := uint64(p.holdTime() / time.Second)
	keepalive := hold / 3
	if p.KeepaliveTime != nil {
		keepalive = uint64(p.KeepaliveTime.Duration / time.Second)
	}
	retry := seconds(p.ConnectRetry, DefaultConnectRetry)
	conf := &api.Peer{
		Conf: &api.PeerConf{NeighborAddress: p.Address, PeerAsn: p.ASN, LocalAsn: p.LocalASN, AuthPassword: password,
			Description: "kube-service-tunnel"},
		// A session reset by BFD (or by us) waits IdleHoldTimeAfterReset
		// before it reconnects; GoBGP's default is 30 s, far longer than a
		// BFD flap. Reconnect as soon as a refused connection would.
		Timers: &api.Timers{Config: &api.TimersConfig{HoldTime: hold, KeepaliveInterval: keepalive,
			ConnectRetry: retry, IdleHoldTimeAfterReset: retry}},
		Transport: &api.Transport{LocalAddress: p.SourceAddress, RemotePort: uint32(p.Port)},
		AfiSafis:  afiSafis,
	}
	if p.EBGPMultihop > 0 {
		conf.EbgpMultihop = &api.EbgpMultihop{Enabled: true, MultihopTtl: uint32(p.EBGPMultihop)}
	}
	if gr := s.cfg.GracefulRestart; gr != nil && gr.Enabled {
		// Every start is flagged as a restart (R bit): the peers keep a
		// crashed router's routes until this new session's End-of-RIB.
		conf.GracefulRestart = &api.GracefulRestart{Enabled: true, RestartTime: uint32(seconds(gr.RestartTime, DefaultRestartTime)),
			LocalRestarting: true}
		for _, a := range conf.AfiSafis {
			a.MpGracefulRestart = &api.MpGracefulRestart{Config: &api.MpGracefulRestartConfig{Enabled: true}}
		}
	}
	if b := p.BFD; b != nil {
		interval := DefaultBFDInterval
		if b.MinInterval != nil {
			interval = b.MinInterval.Duration
		}
		mult := b.Multiplier
		if mult == 0 {
			mult = DefaultBFDMultiplier
		}
		us := uint32(interval / time.Microsecond)
		conf.Bfd = &api.BfdPeerConfig{Enabled: true, DesiredMinimumTxInterval: us, RequiredMinimumReceive: us, DetectionMultiplier: mult}
	}
	return conf, nil
}

// shutdown withdraws everything, lets the withdrawals reach the peers, and
// closes the sessions.
func (s *Speaker) shutdown() {
	if !s.started {
		return
	}
	n := len(s.announced)
	if n > 0 {
		if err := s.server.DeletePath(apiutil.DeletePathRequest{DeleteAll: true}); err != nil {
			s.log.WithError(err).Warn("withdrawing tunnel IPs before exit")
		} else {
			s.announced = map[netip.Addr]netip.Addr{}
			s.metrics.announced.Set(0)
			s.log.WithFields(logrus.Fields{"tunnel_ips": n, "wait": s.cfg.WithdrawWait()}).Info("withdrew every tunnel IP; waiting before closing the BGP sessions")
			time.Sleep(s.cfg.WithdrawWait())
		}
	}
	if err := s.server.StopBgp(context.Background(), &api.StopBgpRequest{}); err != nil {
		s.log.WithError(err).Warn("stopping BGP")
		return
	}
	s.log.Info("BGP sessions closed")
}
