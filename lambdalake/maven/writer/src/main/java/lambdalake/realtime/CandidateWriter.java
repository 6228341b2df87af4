package lambdalake.realtime;

import com.datastax.oss.driver.api.core.ConsistencyLevel;
import com.datastax.oss.driver.api.core.CqlIdentifier;
import com.datastax.oss.driver.api.core.CqlSession;
import com.datastax.oss.driver.api.core.DefaultConsistencyLevel;
import com.datastax.oss.driver.api.core.cql.BatchStatement;
import com.datastax.oss.driver.api.core.cql.BatchType;
import com.datastax.oss.driver.api.core.cql.BoundStatement;
import com.datastax.oss.driver.api.core.cql.ColumnDefinitions;
import com.datastax.oss.driver.api.core.cql.PreparedStatement;
import com.datastax.oss.driver.api.core.servererrors.InvalidQueryException;
import com.datastax.oss.driver.api.core.servererrors.ServerError;
import com.datastax.oss.driver.api.core.servererrors.SyntaxError;
import com.datastax.oss.driver.api.core.servererrors.UnauthorizedException;
import com.datastax.oss.driver.api.core.type.DataType;
import com.datastax.oss.driver.api.core.type.DataTypes;
import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentLinkedQueue;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.apache.logging.log4j.LogManager;
import org.apache.logging.log4j.Logger;
import org.apache.spark.sql.ForeachWriter;
import org.apache.spark.sql.Row;

/**
 * Writes the {@code latest} views' ranked candidates to Cassandra: per candidate the same two
 * statements as the micro-batch path's writer (lambdalake/cassandra/writer.py), an INSERT of the
 * candidate and a DELETE of the key's lower-ranked ones, in one unlogged batch of one partition, at
 * the settings' consistency; a candidate that a better one this task wrote beats is not written.
 *
 * <p>A row is a record: its first column holds a writer schema id the query could not decode (null
 * otherwise), and each later column one view's candidate (a struct of the view table's columns in
 * its order), null where the view does not keep the record. A row with an unknown id stops the task
 * with {@link UnknownWriterSchema}, and the query is started again knowing it, from its checkpoint.
 *
 * <p>Delivery: at least once, idempotent. Writes go out as each row arrives (a bounded number in
 * flight); {@link #close} waits for all of them, so the epoch's offsets are committed only after
 * its candidates are acknowledged. A write that fails for a reason a retry can mend (a timeout, a
 * replica down) is sent again with backoff for up to {@code giveUpAfterMs}, then fails the task.
 */
public final class CandidateWriter extends ForeachWriter<Row> {
  private static final long serialVersionUID = 1L;
  /** Writes in flight per task: bounds memory, not latency (each row is sent on arrival). */
  private static final int IN_FLIGHT = 128;
  /** How much of a failure's message a retry's log line quotes. */
  private static final int QUOTED = 240;
  /** Cassandra 5.0's words for a table its schema lacks. */
  private static final Pattern MISSING_TABLE = Pattern.compile("table \"?([\\w]+)\"? does not exist");

  private static final Logger LOG = LogManager.getLogger(CandidateWriter.class);

  private final Cluster cluster;
  private final String[] insertCqls;
  private final String[] deleteCqls;
  private final int[][] deleteAts;
  private final int[][] orderAts;
  private final String consistency;
  private final long giveUpAfterMs;

  private transient CqlSession session;
  private transient PreparedStatement[] inserts;
  private transient PreparedStatement[] deletes;
  private transient Semaphore slots;
  private transient ConcurrentLinkedQueue<Failed> failed;
  private transient ConsistencyLevel level;
  /** Per view, candidates waiting for a write slot: the best of each key (the latest rule). */
  private transient List<Map<List<Object>, Object[]>> waiting;
  /**
   * Per view, the best candidate of each key this task has written since it opened: a candidate it
   * beats is never written (Cassandra holds the better one, or will when close() returns). Another
   * task may write the key too (a view keyed otherwise than the topic); the read serves the best.
   */
  private transient List<Map<List<Object>, Object[]>> written;
  private transient int queued;
  private transient Object lock;

  /**
   * @param cluster where to connect (contact points, port, credentials, protocol version).
   * @param insertCqls per view, its table's INSERT, one marker a column, in the candidates' order.
   * @param deleteCqls per view, the DELETE of a key's lower candidates (the partition key, the rank).
   * @param deleteAts per view, where the DELETE's values are among a candidate's columns.
   * @param orderAts per view, where a candidate's rank, Kafka partition and offset are.
   * @param consistency a CQL consistency level's name (the settings' {@code consistency}).
   * @param giveUpAfterMs how long a retryable failure is retried before the task fails.
   */
  public CandidateWriter(
      Cluster cluster,
      List<String> insertCqls,
      List<String> deleteCqls,
      List<List<Integer>> deleteAts,
      List<List<Integer>> orderAts,
      String consistency,
      long giveUpAfterMs) {
    this.cluster = cluster;
    this.insertCqls = insertCqls.toArray(new String[0]);
    this.deleteCqls = deleteCqls.toArray(new String[0]);
    this.deleteAts = new int[deleteAts.size()][];
    for (int v = 0; v < this.deleteAts.length; v++) {
      this.deleteAts[v] = deleteAts.get(v).stream().mapToInt(Integer::intValue).toArray();
    }
    this.orderAts = new int[orderAts.size()][];
    for (int v = 0; v < this.orderAts.length; v++) {
      this.orderAts[v] = orderAts.get(v).stream().mapToInt(Integer::intValue).toArray();
    }
    this.consistency = consistency;
    this.giveUpAfterMs = giveUpAfterMs;
  }

  @Override
  public boolean open(long partitionId, long epochId) {
    ExpectedFailures.install();
    session = Sessions.get(cluster);
    inserts = new PreparedStatement[insertCqls.length];
    deletes = new PreparedStatement[deleteCqls.length];
    for (int v = 0; v < inserts.length; v++) {
      inserts[v] = Sessions.prepare(session, insertCqls[v]);
      deletes[v] = Sessions.prepare(session, deleteCqls[v]);
    }
    level = DefaultConsistencyLevel.valueOf(consistency);
    slots = new Semaphore(IN_FLIGHT);
    failed = new ConcurrentLinkedQueue<>();
    waiting = new ArrayList<>();
    written = new ArrayList<>();
    for (int v = 0; v < inserts.length; v++) {
      waiting.add(new HashMap<>());
      written.add(new HashMap<>());
    }
    queued = 0;
    lock = new Object();
    return true;
  }

  @Override
  public void process(Row row) {
    if (!row.isNullAt(0)) {
      throw new UnknownWriterSchema(row.getInt(0));
    }
    retryFailed();
    for (int v = 0; v < inserts.length; v++) {
      if (!row.isNullAt(1 + v)) {
        offer(v, values(v, row.getStruct(1 + v)));
      }
    }
  }

  @Override
  public void close(Throwable error) {
    if (session == null || error != null) {
      return;
    }
    while (true) {
      int view = -1;
      Object[] next = null;
      synchronized (lock) {
        for (int v = 0; v < waiting.size() && next == null; v++) {
          var entries = waiting.get(v).entrySet().iterator();
          if (entries.hasNext()) {
            var entry = entries.next();
            view = v;
            next = entry.getValue();
            entries.remove();
            queued--;
            written.get(v).put(entry.getKey(), next);
          }
        }
      }
      if (next == null) {
        break;
      }
      slots.acquireUninterruptibly();
      write(view, next);
    }
    slots.acquireUninterruptibly(IN_FLIGHT);
    slots.release(IN_FLIGHT);
    while (!failed.isEmpty()) {
      retryFailed();
    }
  }

  private Object[] values(int view, Row candidate) {
    ColumnDefinitions columns = inserts[view].getVariableDefinitions();
    Object[] values = new Object[columns.size()];
    for (int i = 0; i < values.length; i++) {
      values[i] = value(candidate, i, columns.get(i).getType());
    }
    return values;
  }

  /**
   * Writes a candidate now if a slot is free and none waits; otherwise keeps it, or the better of it
   * and the key's waiting one: under a backlog a key's candidates that can never win are not
   * written at all, while a record that finds the writer idle is written as it arrives. A candidate
   * beaten by one this task wrote is dropped: only winners are written.
   */
  private void offer(int view, Object[] values) {
    int[] at = deleteAts[view];
    List<Object> key = new ArrayList<>(at.length - 1);
    for (int i = 0; i < at.length - 1; i++) {
      key.add(values[at[i]]);
    }
    synchronized (lock) {
      Object[] best = written.get(view).get(key);
      if (best != null && !better(view, values, best)) {
        return;
      }
      if (queued == 0 && slots.tryAcquire()) {
        written.get(view).put(key, values);
        write(view, values);
        return;
      }
      Object[] held = waiting.get(view).get(key);
      if (held == null) {
        waiting.get(view).put(key, values);
        queued++;
      } else if (better(view, values, held)) {
        waiting.get(view).put(key, values);
      }
    }
    drain();
  }

  /** Writes waiting candidates while slots are free. */
  private void drain() {
    synchronized (lock) {
      while (queued > 0 && slots.tryAcquire()) {
        for (int v = 0; v < waiting.size(); v++) {
          var entries = waiting.get(v).entrySet().iterator();
          if (entries.hasNext()) {
            var entry = entries.next();
            entries.remove();
            queued--;
            written.get(v).put(entry.getKey(), entry.getValue());
            write(v, entry.getValue());
            break;
          }
        }
      }
    }
  }

  /** Whether candidate {@code a} outranks {@code b}: higher rank, then lower partition, offset. */
  private boolean better(int view, Object[] a, Object[] b) {
    int[] order = orderAts[view];
    int byRank = ((BigInteger) a[order[0]]).compareTo((BigInteger) b[order[0]]);
    if (byRank != 0) {
      return byRank > 0;
    }
    int byPartition = Integer.compare((Integer) a[order[1]], (Integer) b[order[1]]);
    if (byPartition != 0) {
      return byPartition < 0;
    }
    return (Long) a[order[2]] < (Long) b[order[2]];
  }

  /** Sends a candidate whose slot is taken already. */
  private void write(int view, Object[] values) {
    dispatch(statement(view, values), System.currentTimeMillis() + giveUpAfterMs);
  }

  /** Sends a request whose slot is taken; a failure is kept for the task's thread to retry. */
  private void dispatch(BatchStatement batch, long deadline) {
    session
        .executeAsync(batch)
        .whenComplete(
            (result, error) -> {
              if (error != null) {
                // Kept before the slot is freed: close() waits for every slot, then for the kept.
                failed.add(new Failed(batch, error, deadline));
                slots.release();
                return; // no drain: a write that fails at once would recurse here
              }
              slots.release();
              drain();
            });
  }

  private BatchStatement statement(int view, Object[] values) {
    int[] at = deleteAts[view];
    Object[] lower = new Object[at.length];
    for (int i = 0; i < lower.length; i++) {
      lower[i] = values[at[i]];
    }
    BoundStatement row = inserts[view].bind(values);
    BoundStatement below = deletes[view].bind(lower);
    return BatchStatement.newInstance(BatchType.UNLOGGED, row, below).setConsistencyLevel(level);
  }

  private void send(BatchStatement batch, long deadline) {
    slots.acquireUninterruptibly();
    dispatch(batch, deadline);
  }

  /**
   * Sends again each write that failed, after a pause (logged once a pause, as the micro-batch
   * writer does); fails the task on a permanent error.
   */
  private void retryFailed() {
    long delay = 500;
    Failed first;
    while ((first = failed.poll()) != null) {
      if (permanent(first.error)) {
        throw new IllegalStateException(
            "Cassandra refused a candidate write: " + first.error.getMessage(), first.error);
      }
      if (System.currentTimeMillis() > first.deadline) {
        throw new IllegalStateException(
            "a candidate write still failed after " + giveUpAfterMs / 1000 + "s: " + first.error,
            first.error);
      }
      List<Failed> again = new ArrayList<>();
      again.add(first);
      Failed next;
      while ((next = failed.poll()) != null) {
        again.add(next);
      }
      if (lagsSchema(first.error)) {
        LOG.info(
            "{} candidate writes met a coordinator that has not seen the table yet; sending them again",
            again.size());
      } else {
        LOG.warn(
            "{} candidate writes to Cassandra failed ({}); retrying in {}s",
            again.size(),
            summary(first.error),
            delay / 1000.0);
      }
      try {
        TimeUnit.MILLISECONDS.sleep(delay);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new IllegalStateException("interrupted while retrying a candidate write", e);
      }
      delay = Math.min(delay * 2, 10_000);
      for (Failed f : again) {
        send(f.batch, f.deadline);
      }
      slots.acquireUninterruptibly(IN_FLIGHT);
      slots.release(IN_FLIGHT);
    }
  }

  /** A failure in one line: its class and the start of its message (the driver's are long). */
  static String summary(Throwable error) {
    String message = String.valueOf(error.getMessage()).replaceAll("\\s+", " ");
    if (message.length() > QUOTED) {
      message = message.substring(0, QUOTED) + "...";
    }
    return error.getClass().getSimpleName() + ": " + message;
  }

  private boolean permanent(Throwable error) {
    if (lagsSchema(error)) {
      return false;
    }
    return error instanceof InvalidQueryException
        || error instanceof SyntaxError
        || error instanceof UnauthorizedException
        || error instanceof IllegalArgumentException
        || error instanceof ClassCastException;
  }

  /**
   * Whether a coordinator answered as if a table the cluster has did not exist: a node back from an
   * outage that has not pulled the schema of tables created meanwhile ("table X does not exist"), or
   * "Unknown CF". The driver's schema, from the other nodes, has the table: the write goes again,
   * and another node coordinates it (as lambdalake/cassandra/routing.py decides for Python).
   */
  boolean lagsSchema(Throwable error) {
    String message = String.valueOf(error.getMessage());
    if (error instanceof ServerError) {
      return message.contains("Unknown CF");
    }
    if (!(error instanceof InvalidQueryException)) {
      return false;
    }
    Matcher missing = MISSING_TABLE.matcher(message);
    if (!missing.find() || session == null) {
      return false;
    }
    String table = missing.group(1);
    return session.getMetadata().getKeyspaces().values().stream()
        .anyMatch(k -> k.getTable(CqlIdentifier.fromInternal(table)).isPresent());
  }

  /**
   * A row's value as the column's CQL type takes it. The query casts each column to the Spark type
   * of its CQL type first (lambdalake/spark/realtime.py), so only these pairs occur.
   */
  static Object value(Row row, int i, DataType type) {
    if (row.isNullAt(i)) {
      return null;
    }
    Object v = row.get(i);
    if (type.equals(DataTypes.BLOB)) {
      return ByteBuffer.wrap((byte[]) v);
    }
    if (type.equals(DataTypes.VARINT)) {
      return ((BigDecimal) v).toBigIntegerExact();
    }
    if (type.equals(DataTypes.TIMESTAMP)) {
      if (v instanceof java.sql.Timestamp t) {
        return t.toInstant();
      }
      return (Instant) v;
    }
    return v;
  }

  private record Failed(BatchStatement batch, Throwable error, long deadline) {}
}
