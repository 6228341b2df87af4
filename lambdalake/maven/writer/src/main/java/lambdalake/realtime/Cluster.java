package lambdalake.realtime;

import java.io.Serializable;
import java.util.List;
import java.util.Objects;

/**
 * Where a session connects: the settings' contact points, port, credentials, protocol version and
 * TLS (the CA's PEM text itself, not its path: an executor on another host has not the driver's
 * files). The password is never part of {@link #toString}.
 */
public final class Cluster implements Serializable {
  private static final long serialVersionUID = 1L;
  final List<String> hosts;
  final int port;
  final String username;
  final String password;
  final String protocolVersion;
  final long requestTimeoutMs;
  final String caPem;
  final boolean checkHostname;

  /**
   * @param hosts contact points (host names or addresses).
   * @param port the native protocol port.
   * @param username null without authentication.
   * @param password null without authentication.
   * @param protocolVersion "V4", "V5"... or null to negotiate.
   * @param requestTimeoutMs a request's timeout.
   * @param caPem the PEM text of the CA that signed the nodes' certificates; null: no TLS.
   * @param checkHostname with TLS, whether a node's certificate must name the address reached.
   */
  public Cluster(
      List<String> hosts,
      int port,
      String username,
      String password,
      String protocolVersion,
      long requestTimeoutMs,
      String caPem,
      boolean checkHostname) {
    this.hosts = List.copyOf(hosts);
    this.port = port;
    this.username = username;
    this.password = password;
    this.protocolVersion = protocolVersion;
    this.requestTimeoutMs = requestTimeoutMs;
    this.caPem = caPem;
    this.checkHostname = checkHostname;
  }

  @Override
  public boolean equals(Object o) {
    return o instanceof Cluster k
        && hosts.equals(k.hosts)
        && port == k.port
        && Objects.equals(username, k.username)
        && Objects.equals(password, k.password)
        && Objects.equals(protocolVersion, k.protocolVersion)
        && requestTimeoutMs == k.requestTimeoutMs
        && Objects.equals(caPem, k.caPem)
        && checkHostname == k.checkHostname;
  }

  @Override
  public int hashCode() {
    return Objects.hash(hosts, port, username, protocolVersion);
  }

  @Override
  public String toString() {
    return hosts + ":" + port;
  }
}
