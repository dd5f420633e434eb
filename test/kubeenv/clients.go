package kubeenv

import (
	"context"
	"fmt"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// serviceAccountTokenSeconds is the lifetime of tokens from ServiceAccountConfig.
const serviceAccountTokenSeconds = 24 * 60 * 60

// AdminConfig returns a new config for the admin user (group
// system:masters, so RBAC never denies it). TLS is verified against the API
// server's self-signed certificate.
func (e *Env) AdminConfig() *rest.Config {
	return e.configWithToken(e.adminToken)
}

// configWithToken returns a config for the API server with a bearer token.
func (e *Env) configWithToken(token string) *rest.Config {
	return &rest.Config{
		Host:            e.host,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: append([]byte(nil), e.caData...)},
		QPS:             100,
		Burst:           200,
	}
}

// ServiceAccountConfig creates namespace (if missing) and the ServiceAccount
// name in it (if missing), requests a token for it with the TokenRequest API
// and returns a config that authenticates as
// system:serviceaccount:NAMESPACE:NAME, so RBAC applies to it for real.
func (e *Env) ServiceAccountConfig(ctx context.Context, namespace, name string) (*rest.Config, error) {
	cs, err := kubernetes.NewForConfig(e.AdminConfig())
	if err != nil {
		return nil, fmt.Errorf("admin client: %w", err)
	}
	if err := ensureNamespace(ctx, cs, namespace); err != nil {
		return nil, err
	}
	if err := ensureServiceAccount(ctx, cs, namespace, name); err != nil {
		return nil, err
	}
	token, err := requestToken(ctx, cs, namespace, name)
	if err != nil {
		return nil, err
	}
	return e.configWithToken(token), nil
}

// ensureNamespace creates the namespace unless it exists.
func ensureNamespace(ctx context.Context, cs kubernetes.Interface, name string) error {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
	_, err := cs.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create namespace %s: %w", name, err)
	}
	return nil
}

// ensureServiceAccount creates the ServiceAccount unless it exists.
func ensureServiceAccount(ctx context.Context, cs kubernetes.Interface, namespace, name string) error {
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	_, err := cs.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create service account %s/%s: %w", namespace, name, err)
	}
	return nil
}

// requestToken gets a bound token for the ServiceAccount (TokenRequest API).
func requestToken(ctx context.Context, cs kubernetes.Interface, namespace, name string) (string, error) {
	expiry := int64(serviceAccountTokenSeconds)
	req := &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}
	resp, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, req, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request token for service account %s/%s: %w", namespace, name, err)
	}
	return resp.Status.Token, nil
}

// WriteKubeconfig writes a kubeconfig file for cfg (AdminConfig when nil)
// with a single context, "kubeenv", as the current context. It supports
// bearer tokens and client certificates, inline or as files.
func (e *Env) WriteKubeconfig(path string, cfg *rest.Config) error {
	if cfg == nil {
		cfg = e.AdminConfig()
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["kubeenv"] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthority:     cfg.CAFile,
		CertificateAuthorityData: cfg.CAData,
		InsecureSkipTLSVerify:    cfg.Insecure,
		TLSServerName:            cfg.ServerName,
	}
	kc.AuthInfos["kubeenv"] = &clientcmdapi.AuthInfo{
		Token:                 cfg.BearerToken,
		TokenFile:             cfg.BearerTokenFile,
		ClientCertificate:     cfg.CertFile,
		ClientCertificateData: cfg.CertData,
		ClientKey:             cfg.KeyFile,
		ClientKeyData:         cfg.KeyData,
	}
	kc.Contexts["kubeenv"] = &clientcmdapi.Context{Cluster: "kubeenv", AuthInfo: "kubeenv"}
	kc.CurrentContext = "kubeenv"
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}
