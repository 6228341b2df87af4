package lambdalake.realtime;

import com.datastax.oss.driver.api.core.CqlSession;
import com.datastax.oss.driver.api.core.config.DefaultDriverOption;
import com.datastax.oss.driver.api.core.config.DriverConfigLoader;
import com.datastax.oss.driver.api.core.config.ProgrammaticDriverConfigLoaderBuilder;
import com.datastax.oss.driver.api.core.cql.PreparedStatement;
import com.datastax.oss.driver.api.core.ssl.ProgrammaticSslEngineFactory;
import java.io.ByteArrayInputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.security.GeneralSecurityException;
import java.security.KeyStore;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.time.Duration;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;

/**
 * One Cassandra session per executor JVM and cluster, shared by every task (a session holds its
 * connections and prepared statements; opening one per task would cost a second each).
 */
public final class Sessions {
  private static final Map<Cluster, CqlSession> SESSIONS = new ConcurrentHashMap<>();
  private static final Map<String, PreparedStatement> PREPARED = new ConcurrentHashMap<>();

  private Sessions() {}

  public static CqlSession get(Cluster key) {
    CqlSession found = SESSIONS.get(key);
    if (found != null && !found.isClosed()) {
      return found;
    }
    synchronized (SESSIONS) {
      found = SESSIONS.get(key);
      if (found == null || found.isClosed()) {
        found = open(key);
        SESSIONS.put(key, found);
      }
      return found;
    }
  }

  public static PreparedStatement prepare(CqlSession session, String cql) {
    return PREPARED.computeIfAbsent(System.identityHashCode(session) + "\u0000" + cql, k -> session.prepare(cql));
  }

  private static CqlSession open(Cluster key) {
    ProgrammaticDriverConfigLoaderBuilder config =
        DriverConfigLoader.programmaticBuilder()
            // The data center is the contact points' own: no setting a one-DC cluster would need.
            .withString(
                DefaultDriverOption.LOAD_BALANCING_POLICY_CLASS, "DcInferringLoadBalancingPolicy")
            .withDuration(DefaultDriverOption.REQUEST_TIMEOUT, Duration.ofMillis(key.requestTimeoutMs))
            // Back quickly after a Cassandra restart, as the Python sessions come back.
            .withString(DefaultDriverOption.RECONNECTION_POLICY_CLASS, "ConstantReconnectionPolicy")
            .withDuration(DefaultDriverOption.RECONNECTION_BASE_DELAY, Duration.ofSeconds(2))
            .withBoolean(DefaultDriverOption.RECONNECT_ON_INIT, true)
            .withString(DefaultDriverOption.METRICS_FACTORY_CLASS, "NoopMetricsFactory")
            .withBoolean(DefaultDriverOption.TIMESTAMP_GENERATOR_FORCE_JAVA_CLOCK, true)
            // A batch of candidates of many keys draws the server's "unlogged batch covering N
            // partitions" warning on every request, which the driver would log each time (the
            // Python driver keeps them quiet): grouped on purpose, so not logged.
            .withBoolean(DefaultDriverOption.REQUEST_LOG_WARNINGS, false);
    if (key.protocolVersion != null) {
      config = config.withString(DefaultDriverOption.PROTOCOL_VERSION, key.protocolVersion);
    }
    var builder = CqlSession.builder().withConfigLoader(config.build());
    for (String host : key.hosts) {
      builder = builder.addContactPoint(new InetSocketAddress(host, key.port));
    }
    if (key.username != null && key.password != null) {
      builder = builder.withAuthCredentials(key.username, key.password);
    }
    if (key.caPem != null) {
      builder =
          builder.withSslEngineFactory(
              new ProgrammaticSslEngineFactory(trusting(key.caPem), null, key.checkHostname));
    }
    return builder.build();
  }

  /** A TLS context trusting the certificates in {@code pem} (a CA, or several). */
  static SSLContext trusting(String pem) {
    try {
      KeyStore trusted = KeyStore.getInstance(KeyStore.getDefaultType());
      trusted.load(null, null);
      int i = 0;
      for (Certificate cert :
          CertificateFactory.getInstance("X.509")
              .generateCertificates(new ByteArrayInputStream(pem.getBytes(StandardCharsets.US_ASCII)))) {
        trusted.setCertificateEntry("ca-" + i++, cert);
      }
      TrustManagerFactory factory =
          TrustManagerFactory.getInstance(TrustManagerFactory.getDefaultAlgorithm());
      factory.init(trusted);
      SSLContext context = SSLContext.getInstance("TLS");
      context.init(null, factory.getTrustManagers(), null);
      return context;
    } catch (GeneralSecurityException | java.io.IOException e) {
      throw new IllegalArgumentException("the Cassandra CA (ssl_ca_location) is not a PEM certificate", e);
    }
  }
}
